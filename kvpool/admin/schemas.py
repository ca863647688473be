"""Declared request and response bodies of the admin REST API (version 1).

Responses wrap what the master returns in a versioned envelope; the master's records (node,
stats, key info) are its own documents and pass through as JSON objects, so this file does not
duplicate the master's tables. Every error body is `ErrorBody`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

API_VERSION = 1


class Versioned(BaseModel):
    version: int = API_VERSION


class Health(Versioned):
    status: str  # "ok" | "not ready"
    detail: str = ""


class ErrorDetail(BaseModel):
    code: str  # a kvpool.errors code: invalid_argument, not_found, unauthorized, ...
    message: str


class ErrorBody(Versioned):
    error: ErrorDetail


class Nodes(Versioned):
    nodes: list[dict[str, Any]]


class Node(Versioned):
    node: dict[str, Any]


class Stats(Versioned):
    stats: dict[str, Any]


class KeyInfo(Versioned):
    key: str
    info: dict[str, Any]


class Keys(Versioned):
    keys: list[str]


class Done(Versioned):
    """The answer of a mutating call: what the master reported doing."""

    result: Any = None


class EvictRequest(Versioned):
    """Evict until `target_bytes` are free(d), or evict exactly `keys`; one of the two."""

    model_config = ConfigDict(extra="forbid")

    target_bytes: int | None = Field(None, ge=1)
    keys: list[str] | None = Field(None, min_length=1, max_length=100_000)

    @model_validator(mode="after")
    def _one_of(self) -> "EvictRequest":
        if (self.target_bytes is None) == (self.keys is None):
            raise ValueError("give exactly one of target_bytes or keys")
        return self


class Config(Versioned):
    config: dict[str, Any]
