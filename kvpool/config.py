"""One configuration model for every kvpool service: file, `KVPOOL_*` environment, flags.

Precedence (highest first): command-line flags, `KVPOOL_*` environment variables, the file
named by `--config` or `KVPOOL_CONFIG` (JSON or TOML), then the defaults below. Nested fields use
`__` in the environment: `KVPOOL_DRAM_CAPACITY=4GiB`.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path
from typing import Any

from pydantic import field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvpool.errors import InvalidArgument

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}


def parse_size(value: int | str) -> int:
    """`"4GiB"`, `"512m"`, `1048576` -> bytes."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise InvalidArgument(f"not a size: {value!r} (use e.g. 512MiB, 4GiB, 1048576)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


class Settings(BaseSettings):
    """Settings shared by `kvpool serve | master | node | router | worker`."""

    model_config = SettingsConfigDict(env_prefix="KVPOOL_", env_nested_delimiter="__", extra="ignore")

    # Where services listen (loopback by default: exposing a pool is a deliberate choice).
    host: str = "127.0.0.1"
    port: int = 7600  # pool RPC (embedded serve / master)
    admin_port: int = 7680  # REST admin API + /metrics; 0 disables
    master: str = "127.0.0.1:7600"  # where nodes and clients find the master
    meta: str | None = None  # "etcd://127.0.0.1:2379" for cluster mode; None = embedded
    node_id: str | None = None

    # Tiers of one node.
    dram_capacity: int = 1 << 30
    ssd_path: str | None = None  # None: no SSD tier
    ssd_capacity: int = 8 << 30
    hbm_capacity: int = 0  # bytes of device memory; 0 = no HBM tier
    eviction: str = "s3fifo"  # "lru" | "s3fifo"

    # Pool behaviour.
    replicas: int = 1
    put_timeout_s: float = 30.0  # a put that never ends is reclaimed after this
    lease_s: float = 10.0
    heartbeat_s: float = 1.0
    transports: list[str] = ["shm", "tcp"]

    # KV.
    chunk_tokens: int = 256

    admin_token: str | None = None  # bearer token for mutating admin endpoints
    log_level: str = "INFO"

    @field_validator("dram_capacity", "ssd_capacity", "hbm_capacity", mode="before")
    @classmethod
    def _size(cls, value: Any) -> int:
        return parse_size(value)


def load_settings(config_file: str | os.PathLike | None = None, **overrides: Any) -> Settings:
    """Build settings from a file (JSON or TOML), the environment, then `overrides` (flags).

    Overrides whose value is None are ignored, so CLI options can pass their raw values.
    """
    path = config_file or os.environ.get("KVPOOL_CONFIG")
    file_values: dict[str, Any] = {}
    if path:
        p = Path(path)
        if not p.exists():
            raise InvalidArgument(f"config file {p} does not exist")
        text = p.read_text()
        try:
            file_values = tomllib.loads(text) if p.suffix == ".toml" else json.loads(text)
        except (ValueError, tomllib.TOMLDecodeError) as exc:
            raise InvalidArgument(f"config file {p} is not valid {p.suffix or 'JSON'}: {exc}") from None
    env_values = Settings().model_dump(exclude_unset=True)
    merged = {**file_values, **env_values, **{k: v for k, v in overrides.items() if v is not None}}
    try:
        return Settings(**merged)
    except ValueError as exc:
        raise InvalidArgument(f"invalid configuration: {exc}") from None
