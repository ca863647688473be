"""One configuration model for every kvpool service: file, `KVPOOL_*` environment, flags.

Precedence (highest first): command-line flags, `KVPOOL_*` environment variables, the file
named by `--config` or `KVPOOL_CONFIG` (JSON or TOML), then the defaults below. Every field is
one environment variable: `KVPOOL_DRAM_CAPACITY=4GiB`, `KVPOOL_TRANSPORTS=tcp,shm` (a list is
comma-separated or JSON).

Invariants: `load_settings` either returns fully validated `Settings` or raises
`InvalidArgument` naming the bad field and where it came from (file, environment, flag); an
unknown top-level key in a config file is an error, not silently ignored (a typo must not
quietly run a pool with default capacities); tables (`[pool]`, `[[workers]]`) belong to other
tools reading the same file and are skipped.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from pydantic_settings.exceptions import SettingsError

from kvpool.errors import InvalidArgument

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}
TRANSPORTS = ("shm", "tcp", "rdma")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


# The pool's one default eviction policy (Settings, TieredStore): ARC beat LRU at every cache size
# on the conversation trace, S3-FIFO only at 2% (docs/bench-history.md).
DEFAULT_EVICTION = "arc"


def parse_size(value: int | str) -> int:
    """`"4GiB"`, `"512m"`, `1048576` -> bytes (never negative)."""
    if isinstance(value, bool):  # bool is an int subclass; `true` is never a size
        raise InvalidArgument(f"not a size: {value!r} (use e.g. 512MiB, 4GiB, 1048576)")
    if isinstance(value, int):
        if value < 0:
            raise InvalidArgument(f"a size must not be negative, got {value}")
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise InvalidArgument(f"not a size: {value!r} (use e.g. 512MiB, 4GiB, 1048576)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


class RpcSettings(BaseSettings):
    """The pool RPC's knobs (`kvpool.rpc`), part of `Settings`; an SDK client, which has no
    settings file, reads just these from the environment. Spinning: `kvpool.rpc.spin`."""

    model_config = SettingsConfigDict(env_prefix="KVPOOL_", extra="ignore")

    rpc_spin: int = Field(64, ge=0)  # polls a client may make for a reply before sleeping (0: off)
    server_spin: int = Field(64, ge=0)  # polls a server thread may make for its sole client's next request
    # nobody spins while some task waited for a CPU more than this % of the last 10 s (Linux PSI; 100: no check)
    spin_max_cpu_pressure: float = Field(10.0, ge=0, le=100)
    rpc_unix: bool = True  # same-host clients move to the server's abstract unix socket (Linux)
    # a node serves its connections from one epoll loop thread, answering gets there (kvpool.rpc.loop);
    # False: a thread per connection
    rpc_loop: bool = True
    # Authentication (kvpool.security.keyring): a keyring file turns it on for every port; a client speaks as
    # `principal` from it. None: off, and services listen on loopback only (protected mode).
    auth_file: str | None = None
    principal: str | None = None
    # Limits of every pool RPC and transfer data connection (`transfer.framing.Limits`); 0: off.
    # A stalled or slow peer holds its connection for about one header timeout (the tick), no more.
    header_timeout_s: float = Field(10.0, ge=0)  # a started frame header must finish within this (2 ticks)
    idle_timeout_s: float = Field(300.0, ge=0)  # a server closes a connection with no request for this long
    min_body_rate: int = 64 << 10  # bytes/s a message body or payload in flight must keep up
    max_connections: int = Field(1024, ge=0)  # open (authenticated, with a keyring) connections per server
    max_connections_per_peer: int = Field(256, ge=0)  # without a keyring: ... per peer address (IP)
    # With a keyring (`transfer.listener`): connections not yet authenticated have a budget of their
    # own, so that nobody without a credential can lock out those with one.
    max_unauthenticated: int = Field(1024, ge=0)  # per server; a new one over it replaces the oldest
    max_unauthenticated_per_peer: int = Field(128, ge=0)  # ... per peer address
    handshake_timeout_s: float = Field(3.0, ge=0)  # from accept to authenticated
    max_connections_per_principal: int = Field(256, ge=0)  # authenticated, per principal (not `node`)
    max_reply_bytes: int = 1 << 30  # a client refuses a reply (message + payload) announcing more

    @field_validator("min_body_rate", "max_reply_bytes", mode="before")
    @classmethod
    def _limit_size(cls, value: Any) -> int:
        return parse_size(value)

    def limits(self) -> Any:
        """These limits as `transfer.framing.Limits` (the pool RPC and the data server share them)."""
        from transfer.framing import Limits

        return Limits(self.header_timeout_s, self.idle_timeout_s, self.min_body_rate, self.max_connections,
                      self.max_connections_per_peer, self.max_unauthenticated, self.max_unauthenticated_per_peer,
                      self.handshake_timeout_s, self.max_connections_per_principal)


class Settings(RpcSettings):
    """Settings shared by `kvpool serve | master | node | router | worker`."""

    model_config = SettingsConfigDict(env_prefix="KVPOOL_", env_nested_delimiter="__", extra="ignore")

    # Where services listen (loopback by default: exposing a pool is a deliberate choice).
    host: str = "127.0.0.1"
    port: int = Field(7600, ge=0, le=65535)  # pool RPC (embedded serve / master)
    admin_port: int = Field(7680, ge=0, le=65535)  # REST admin API + /metrics; 0 disables
    master: str = "127.0.0.1:7600"  # where nodes and clients find the master
    meta: str | None = None  # "etcd://127.0.0.1:2379" for cluster mode; None = embedded
    node_id: str | None = None

    # Tiers of one node.
    dram_capacity: int = 1 << 30
    ssd_path: str | None = None  # None: no SSD tier
    ssd_capacity: int = 8 << 30
    shm_index_slots: int = Field(-1, ge=-1)  # same-host readers' DRAM index: -1 sized from DRAM, 0 off
    eviction: str = DEFAULT_EVICTION  # "lru" | "s3fifo" | "arc"

    # Pool behaviour.
    replicas: int = Field(1, ge=1)
    put_timeout_s: float = Field(30.0, gt=0)  # a put that never ends is reclaimed after this
    lease_s: float = Field(10.0, gt=0)
    heartbeat_s: float = Field(1.0, gt=0)
    # How long a master remembers each acknowledged remove by key (kvpool.master.state).
    removal_memory_s: float = Field(60.0, gt=0)
    # NoDecode: the environment form is "tcp,shm"; pydantic-settings would insist on JSON.
    transports: Annotated[list[str], NoDecode] = ["shm", "tcp"]

    # KV.
    chunk_tokens: int = Field(256, ge=1)

    admin_token: str | None = None  # bearer token of the admin API (every endpoint but /health, /ready)
    admin_token_file: str | None = None  # ... read from this file (a mounted secret); never put it on argv
    # bearer token a Prometheus scraper presents: /metrics only (a node's, a master's, the router's,
    # workers'); required for a node's /metrics when a keyring is set
    metrics_token: str | None = None
    metrics_token_file: str | None = None  # ... read from this file
    log_level: str = "INFO"

    @field_validator("dram_capacity", "ssd_capacity", mode="before")
    @classmethod
    def _size(cls, value: Any) -> int:
        return parse_size(value)

    @field_validator("shm_index_slots")
    @classmethod
    def _slots(cls, value: int) -> int:
        if value > 0 and value & (value - 1):
            raise ValueError(f"shm_index_slots must be -1 (auto), 0 (off) or a power of two, got {value}")
        return value

    @field_validator("transports", mode="before")
    @classmethod
    def _transports(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            value = json.loads(text) if text.startswith("[") else [p.strip() for p in text.split(",") if p.strip()]
        if isinstance(value, list):
            unknown = [t for t in value if t not in TRANSPORTS]
            if unknown or not value:
                raise ValueError(f"transports must be a non-empty subset of {list(TRANSPORTS)}, got {value}")
        return value

    @field_validator("admin_token", "metrics_token", mode="before")
    @classmethod
    def _token(cls, value: Any) -> Any:
        # An empty KVPOOL_ADMIN_TOKEN= means "no token", not "the empty string is the token".
        return None if value == "" else value

    @model_validator(mode="after")
    def _token_file(self) -> "Settings":
        if self.admin_token_file and not self.admin_token:
            self.admin_token = read_secret_file(self.admin_token_file, "admin_token_file")
        if self.metrics_token_file and not self.metrics_token:
            self.metrics_token = read_secret_file(self.metrics_token_file, "metrics_token_file")
        return self

    @field_validator("log_level", mode="before")
    @classmethod
    def _log_level(cls, value: Any) -> Any:
        if isinstance(value, str) and value.upper() in LOG_LEVELS:
            return value.upper()
        raise ValueError(f"log_level must be one of {list(LOG_LEVELS)}, got {value!r}")


def read_secret_file(path: str | os.PathLike, what: str) -> str:
    """A token from a file (its first line, stripped). Refused when others may read it: a mounted
    Kubernetes secret is group-readable (fsGroup) but not world-readable."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
        text = p.read_text()
    except OSError as exc:
        raise InvalidArgument(f"{what} {p}: {exc.strerror or exc}") from None
    if mode & 0o007:
        raise InvalidArgument(f"{what} {p} is readable by others (mode {mode & 0o777:o}); run: chmod 600 {p}")
    token = text.strip().splitlines()[0].strip() if text.strip() else ""
    if not token:
        raise InvalidArgument(f"{what} {p} is empty")
    return token


def _explain(exc: Exception) -> str:
    """One readable line per bad field (pydantic's own text, without its URLs)."""
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'value'}: {e['msg']}" for e in exc.errors())
    return str(exc)


def _read_file(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise InvalidArgument(f"config file {p} does not exist")
    if p.suffix not in (".toml", ".json"):
        raise InvalidArgument(f"config file {p}: use a .toml or .json file")
    try:
        values = tomllib.loads(p.read_text()) if p.suffix == ".toml" else json.loads(p.read_text())
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise InvalidArgument(f"config file {p} is not valid {p.suffix[1:].upper()}: {exc}") from None
    if not isinstance(values, dict):
        raise InvalidArgument(f"config file {p} must hold one object of settings, got {type(values).__name__}")
    unknown = sorted(k for k, v in values.items() if k not in Settings.model_fields and not _is_section(v))
    if unknown:
        raise InvalidArgument(f"config file {p}: unknown setting(s) {unknown}; known: {sorted(Settings.model_fields)}")
    return {k: v for k, v in values.items() if k in Settings.model_fields}


def _is_section(value: Any) -> bool:
    """A TOML table (`[pool]`) or array of tables (`[[workers]]`): another tool's part of a shared
    file (`kvpool up` reads deploy/local.toml), not a misspelt setting."""
    if isinstance(value, list):
        return bool(value) and all(isinstance(v, dict) for v in value)
    return isinstance(value, dict)


def load_settings(config_file: str | os.PathLike | None = None, **overrides: Any) -> Settings:
    """Build settings from a file (JSON or TOML), the environment, then `overrides` (flags).

    Overrides whose value is None are ignored, so CLI options can pass their raw values.
    Raises `InvalidArgument` for a missing or malformed file, an unknown key in it, or a value
    that does not validate, naming where the bad value came from.
    """
    path = config_file or os.environ.get("KVPOOL_CONFIG")
    file_values = _read_file(path) if path else {}
    try:
        env_values = Settings().model_dump(exclude_unset=True)
    except (ValidationError, SettingsError, InvalidArgument) as exc:
        raise InvalidArgument(f"invalid KVPOOL_* environment variable: {_explain(exc)}") from None
    flags = {k: v for k, v in overrides.items() if v is not None}
    merged = {**file_values, **env_values, **flags}
    try:
        return Settings(**merged)
    except (ValidationError, SettingsError, InvalidArgument) as exc:
        where = f"config file {path} or flags" if path else "flags"
        raise InvalidArgument(f"invalid configuration ({where}): {_explain(exc)}") from None
