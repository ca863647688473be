"""The configuration tree: one model, one section per part of kvpool, each default once.

    [pool]       the pool as a whole: where it listens and is found, replicas, leases, chunk format
    [node]       one store node: its tiers, eviction, data transports
    [rpc]        the pool's connections: spinning, same-host fast paths, limits, RDMA device
    [security]   keyring, principal, tokens, tenant salt, HTTP body cap
    [router]     `kvpool router`
    [worker]     `kvpool worker` (every worker `kvpool up` starts, too)
    [connector]  the engine plug-ins (vLLM, SGLang, LMCache) where the engine's own config is silent
    [up]         `kvpool up`'s own choices; `[[workers]]` lists the workers it starts
    log_level

How a file, the environment and flags fill it: `kvpool.config.load`. Invariant: a field's default
is written here and nowhere else; code that needs one without a loaded tree asks `default("a.b")`.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvpool.errors import InvalidArgument

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}
TRANSPORTS = ("shm", "tcp", "rdma")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOOPBACK = "127.0.0.1"  # every service listens here unless told otherwise: exposing one is a choice
POOL_PORT = 7600

# The pool's one default eviction policy (node.eviction, TieredStore): ARC beat LRU at every cache
# size on the conversation trace, S3-FIFO only at 2% (docs/bench-history.md).
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


def _list(value: Any) -> Any:
    """The environment's and a flag's form of a list: "a,b" or JSON."""
    if isinstance(value, str):
        text = value.strip()
        return json.loads(text) if text.startswith("[") else [p.strip() for p in text.split(",") if p.strip()]
    return value


def _sizes(*names: str) -> Any:
    return field_validator(*names, mode="before")(lambda cls, v: v if v is None else parse_size(v))


Size = Annotated[int, Field(ge=0)]
StrList = list[str]  # also "a,b" or JSON where a string is given (`_list`)


class Section(BaseModel):
    """A table of the tree. `SHORT_ENV`: its fields also answer to `KVPOOL_<FIELD>` (the names the
    pool's settings always had); every field answers to `KVPOOL_<SECTION>__<FIELD>`."""

    model_config = ConfigDict(extra="forbid")
    SHORT_ENV: ClassVar[bool] = False
    ALIASES: ClassVar[dict[str, str]] = {}  # field -> another environment name the outside world uses
    SECRETS: ClassVar[tuple[str, ...]] = ()  # never printed (`kvpool config show`, the admin API)


class PoolSection(Section):
    """`kvpool serve | master` listen here; nodes, workers, connectors and clients find the pool at
    `master`. The chunk format (`chunk_tokens`, `kv_codec`) is every writer's: workers and engines
    that share KV must agree on it."""

    SHORT_ENV = True

    host: str = LOOPBACK  # where serve, master and node listen
    port: int = Field(POOL_PORT, ge=0, le=65535)  # pool RPC (0: any free port)
    admin_port: int = Field(7680, ge=0, le=65535)  # REST admin API + /metrics; 0 disables
    master: str = f"{LOOPBACK}:{POOL_PORT}"  # where nodes, workers and engines find the pool (KVPOOL_MASTER)
    meta: str | None = None  # "etcd://HOST:PORT" (etcds:// for TLS) for cluster mode; None: standalone
    etcd_ca_file: str | None = None  # etcds://: the CA of etcd's server certificate
    etcd_cert_file: str | None = None  # ... this process's client certificate and key (both or neither)
    etcd_key_file: str | None = None
    replicas: int = Field(1, ge=1)
    put_timeout_s: float = Field(30.0, gt=0)  # a put that never ends is reclaimed after this
    lease_s: float = Field(10.0, gt=0)  # how long a reader's lease keeps an object from eviction
    heartbeat_s: float = Field(1.0, gt=0)
    removal_memory_s: float = Field(60.0, gt=0)  # how long a master remembers each acknowledged remove
    chunk_tokens: int = Field(256, ge=1)  # tokens per KV chunk
    # how KV chunks are stored (kvpool.codec): none (lossless), int8, fp8, +zstd; part of the namespace
    kv_codec: str = "none"  # (its users check the name: kvpool.codec is a layer above this one)


class NodeSection(Section):
    """One store node (`kvpool serve | node`)."""

    SHORT_ENV = True

    node_id: str | None = None  # default host:port
    dram_capacity: Size = 1 << 30
    ssd_path: str | None = None  # a directory for the SSD tier (lmdb); None: no SSD tier
    ssd_capacity: Size = 8 << 30
    eviction: Literal["lru", "s3fifo", "arc"] = DEFAULT_EVICTION
    shm_index_slots: int = Field(-1, ge=-1)  # same-host readers' DRAM index: -1 sized from DRAM, 0 off
    transports: StrList = ["shm", "tcp"]  # the node's data transports ("tcp,shm" in the environment)
    # processes beside the node serving TCP gets of DRAM objects from its shm arena and index on one
    # shared read port (kvpool.node.readers): -1 min(CPUs, 4) - 1, 0 off
    read_workers: int = Field(-1, ge=-1, le=64)
    read_port: int = Field(0, ge=0, le=65535)  # the read workers' port (0: any free port)

    _size = _sizes("dram_capacity", "ssd_capacity")

    @field_validator("shm_index_slots")
    @classmethod
    def _slots(cls, value: int) -> int:
        if value > 0 and value & (value - 1):
            raise ValueError(f"must be -1 (auto), 0 (off) or a power of two, got {value}")
        return value

    @field_validator("transports", mode="before")
    @classmethod
    def _transports(cls, value: Any) -> Any:
        value = _list(value)
        if isinstance(value, list) and (not value or any(t not in TRANSPORTS for t in value)):
            raise ValueError(f"must be a non-empty subset of {list(TRANSPORTS)}, got {value}")
        return value


class RpcSection(Section):
    """The pool's connections (`kvpool.rpc`, the data path); an SDK client reads these too.
    Spinning: `kvpool.rpc.spin`. Limits: `transfer.framing.Limits`, 0 turns one off; a stalled or
    slow peer holds its connection for about one header timeout (the tick), no more."""

    SHORT_ENV = True

    rpc_spin: int = Field(64, ge=0)  # polls a client may make for a reply before sleeping (0: off)
    server_spin: int = Field(64, ge=0)  # polls a server thread may make for its sole client's next request
    # nobody spins while some task waited for a CPU more than this % of the last 10 s (Linux PSI; 100: no check)
    spin_max_cpu_pressure: float = Field(10.0, ge=0, le=100)
    rpc_unix: bool = True  # same-host clients move to the server's abstract unix socket (Linux)
    # a node or master serves its connections from one epoll loop thread, answering gets and lookups
    # there (kvpool.rpc.loop); False: a thread per connection
    rpc_loop: bool = True
    shm_index: bool = True  # same-host readers read a node's DRAM through its seqlock index (x86-64)
    rdma_device: str | None = None  # the RDMA device to open (default: the first)
    rdma_gid_index: int = Field(0, ge=0)
    header_timeout_s: float = Field(10.0, ge=0)  # a started frame header must finish within this (2 ticks)
    idle_timeout_s: float = Field(300.0, ge=0)  # a server closes a connection with no request for this long
    min_body_rate: Size = 64 << 10  # bytes/s a message body or payload in flight must keep up
    max_connections: int = Field(1024, ge=0)  # open (authenticated, with a keyring) connections per server
    max_connections_per_peer: int = Field(256, ge=0)  # without a keyring: ... per peer address (IP)
    # With a keyring, connections not yet authenticated have a budget of their own, so that nobody
    # without a credential can lock out those with one.
    max_unauthenticated: int = Field(1024, ge=0)  # per server; a new one over it replaces the oldest
    max_unauthenticated_per_peer: int = Field(128, ge=0)  # ... per peer address
    handshake_timeout_s: float = Field(3.0, ge=0)  # from accept to authenticated
    max_connections_per_principal: int = Field(256, ge=0)  # authenticated, per principal (not `node`)
    max_reply_bytes: Size = 1 << 30  # a client refuses a reply (message + payload) announcing more

    _size = _sizes("min_body_rate", "max_reply_bytes")

    def limits(self) -> Any:
        """These limits as `transfer.framing.Limits` (the pool RPC and the data server share them)."""
        from transfer.framing import Limits

        return Limits(self.header_timeout_s, self.idle_timeout_s, self.min_body_rate, self.max_connections,
                      self.max_connections_per_peer, self.max_unauthenticated, self.max_unauthenticated_per_peer,
                      self.handshake_timeout_s, self.max_connections_per_principal)


class SecuritySection(Section):
    """Who is asking (`kvpool.security`; docs/security.md). A keyring file turns authentication on
    for every port; without one, services listen on loopback only (protected mode). Secrets come
    from files or the environment, never from argv (any local user reads it in `ps`)."""

    SHORT_ENV = True
    SECRETS = ("admin_token", "metrics_token", "tenant_salt")

    auth_file: str | None = None  # the keyring
    principal: str | None = None  # who this process is in it (default: its only one, else `node`)
    admin_token: str | None = None  # bearer token of the admin API (every endpoint but /health, /ready)
    admin_token_file: str | None = None  # ... read from this file (a mounted secret)
    # bearer token a Prometheus scraper presents: /metrics only; required for a node's /metrics with a keyring
    metrics_token: str | None = None
    metrics_token_file: str | None = None
    # router <-> workers bearer token with a keyring (default: derived from the keyring's node secret)
    internal_token_file: str | None = None
    # keeps this deployment's KV namespace apart from others' (with a keyring: derived per tenant)
    tenant_salt: str | None = None
    tenant_salt_file: str | None = None
    http_max_body: Size = 1 << 20  # request bodies of the HTTP APIs (a 100k-token prompt is ~400 KB of JSON)
    # Without auth_file: this user's own keyring and tokens, made on first use (kvpool.security.local); false: none
    local_auth: bool = True
    local_dir: str | None = None  # where they live (default $XDG_CONFIG_HOME/kvpool, else ~/.config/kvpool)

    _size = _sizes("http_max_body")

    @field_validator("admin_token", "metrics_token", "tenant_salt", mode="before")
    @classmethod
    def _empty_is_none(cls, value: Any) -> Any:
        # an empty KVPOOL_ADMIN_TOKEN= means "no token", not "the empty string is the token"
        return None if value == "" else value

    @model_validator(mode="after")
    def _files(self) -> "SecuritySection":
        for name in ("admin_token", "metrics_token", "tenant_salt"):
            path = getattr(self, f"{name}_file")
            if path and not getattr(self, name):
                setattr(self, name, read_secret_file(path, f"{name}_file"))
        return self


class RouterSection(Section):
    """`kvpool router`: the OpenAI API and where it places requests (docs/router.md)."""

    host: str = LOOPBACK
    port: int = Field(8000, ge=0, le=65535)
    pool: str | None = None  # pool address for match_prefix; None: only the workers' own caches count
    engine: Literal["reference", "vllm"] = "reference"  # the workers: reference workers or vLLM servers
    policy: Literal["cache_aware", "least_loaded", "round_robin"] = "cache_aware"
    workers: StrList = []  # "[ROLE=]URL" to route to; workers started with a router URL join by themselves
    ttft_slo_ms: float | None = Field(None, gt=0)  # refuse (429) when the best estimated TTFT is above this
    tbt_slo_ms: float | None = Field(None, gt=0)  # decode only where the time between tokens stays under this
    local_prefill_tokens: int = Field(256, ge=0)  # uncached prompts this short prefill on the decode worker
    default_max_tokens: int = Field(1024, ge=1)  # completion budget of chat requests without max_tokens
    model_name: str | None = None  # the name /v1/models lists; default: the workers' model id
    # engine vllm: the model folder the servers load (tokenizer, chat template, config.json)
    tokenizer: str | None = None
    # engine vllm: the servers' kv_connector_extra_config, so the router hashes prompts into their key space
    kv_connector_config: dict[str, Any] = {}
    kv_dtype: Literal["bfloat16", "float16", "float32"] | None = None  # engine vllm: the servers' --dtype
    kv_events: StrList = []  # engine vllm: "URL=ENDPOINT[,REPLAY]" where each server publishes KV events

    _lists = field_validator("workers", "kv_events", mode="before")(lambda cls, v: _list(v))

    @field_validator("kv_connector_config", mode="before")
    @classmethod
    def _json(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else {}
            except ValueError as exc:
                raise ValueError(f"not JSON: {exc}") from None
            if not isinstance(value, dict):
                raise ValueError("expected a JSON object")
        return value


class WorkerSection(Section):
    """`kvpool worker`: a reference worker (reference_worker/). Its chunk format is `[pool]`'s."""

    ALIASES = {"model_cache": "KVPOOL_MODEL_CACHE"}

    host: str = LOOPBACK
    port: int = Field(0, ge=0, le=65535)  # 0: any free port
    pool: str | None = None  # pool address; None: `[pool] master`; "none": share nothing (a baseline)
    router: str | None = None  # register with this router URL (and tell it on drain)
    local_cache: Size = 512 << 20  # the worker's own prefix cache in front of the pool (0 disables)
    max_batch: int = Field(32, ge=1)  # most sequences in a decode batch
    max_kv_tokens: int | None = Field(65536, ge=0)  # most KV tokens the decode batch may hold (0/None: no cap)
    # prefill at most this many tokens between decode steps; None: the whole prompt on "prefill",
    # 512 where decode runs ("both", "decode"): decode priority needs gaps
    prefill_chunk_tokens: int | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    model_cache: str | None = None  # where the converted model is cached (default ~/.cache/kvpool/models)
    drain_timeout_s: float = Field(60.0, ge=0)  # on SIGTERM: wait at most this long for open streams
    threads: int | None = Field(None, ge=1)  # torch intra-op threads (default: one per core of `cpus`)
    cpus: str | None = None  # run on these cores only, e.g. "0" or "2-3"

    _size = _sizes("local_cache")


class ConnectorSection(Section):
    """The engine plug-ins (`engine_adapters`: vLLM, SGLang, LMCache). Each engine's own config
    (kv_connector_extra_config, extra_config) wins; these fill what it leaves out, as do `[pool]`
    (master, chunk_tokens, kv_codec) and `[security]` (keyring, principal, tenant salt)."""

    ALIASES = {"allow_untested": "KVPOOL_ALLOW_UNTESTED"}

    weights_fingerprint: str = "unversioned"  # part of the namespace: engines whose weights differ never share
    allow_untested: bool = False  # run with an engine release outside the tested series (docs/compatibility.md)


class UpSection(Section):
    """`kvpool up`'s own choices (the processes it starts read the rest of this tree)."""

    workdir: str | None = None  # logs and ready files (default: a new temporary directory)
    cpus_per_worker: int = Field(0, ge=0)  # cores of its own for each worker, in order (0: no pinning)
    vllm_python: str | None = None  # router.engine vllm: the Python that runs the servers (default: this one)
    vllm_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"  # ... the servers' --dtype
    vllm_args: StrList = []  # ... extra flags for every vLLM server

    _lists = field_validator("vllm_args", mode="before")(lambda cls, v: _list(v))


class UpWorker(BaseModel):
    """One worker `kvpool up` starts: its role, and `[worker]` settings of its own."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["prefill", "decode", "both"]
    name: str = ""
    settings: dict[str, Any] = {}  # over `[worker]`, for this worker only

    @model_validator(mode="before")
    @classmethod
    def _gather(cls, value: Any) -> Any:
        """A `[[workers]]` table is flat (role, name and worker settings side by side)."""
        if not isinstance(value, dict):
            return value
        own = {k: v for k, v in value.items() if k in ("role", "name", "settings")}
        rest = {k: v for k, v in value.items() if k not in own}
        unknown = sorted(set(rest) - set(WorkerSection.model_fields))
        if unknown:
            raise ValueError(f"unknown worker setting(s) {unknown}; known: role, name, "
                             f"{', '.join(WorkerSection.model_fields)}")
        WorkerSection(**rest)  # each value checked now, not in the worker process
        return {**own, "settings": {**own.get("settings", {}), **rest}}


SECTIONS: dict[str, type[Section]] = {
    "pool": PoolSection, "node": NodeSection, "rpc": RpcSection, "security": SecuritySection,
    "router": RouterSection, "worker": WorkerSection, "connector": ConnectorSection, "up": UpSection,
}
DEFAULT_WORKERS = [{"role": "prefill"}, {"role": "decode"}]


class Settings(BaseSettings):
    """The whole tree. Services take it whole and read their sections (`settings.pool.port`).
    `Settings(...)` is its keyword arguments over the `KVPOOL_*` environment; flat keywords
    (`Settings(port=0, dram_capacity="64MiB")`) are short names, placed in their sections. With a
    file and with where each value came from: `kvpool.config.load_settings`."""

    model_config = SettingsConfigDict(extra="forbid")
    _sources: dict[str, str] = PrivateAttr(default_factory=dict)  # "section.field" -> origin (load_settings)

    log_level: Literal[LOG_LEVELS] = "INFO"  # type: ignore[valid-type]
    pool: PoolSection = Field(default_factory=PoolSection)
    node: NodeSection = Field(default_factory=NodeSection)
    rpc: RpcSection = Field(default_factory=RpcSection)
    security: SecuritySection = Field(default_factory=SecuritySection)
    router: RouterSection = Field(default_factory=RouterSection)
    worker: WorkerSection = Field(default_factory=WorkerSection)
    connector: ConnectorSection = Field(default_factory=ConnectorSection)
    up: UpSection = Field(default_factory=UpSection)
    workers: list[UpWorker] = Field(default_factory=lambda: [UpWorker(**w) for w in DEFAULT_WORKERS])  # `kvpool up`'s

    @classmethod
    def settings_customise_sources(cls, settings_cls: Any, init_settings: Any, **others: Any) -> tuple:
        from kvpool.config.load import EnvSource

        return init_settings, EnvSource(settings_cls)

    @field_validator("log_level", mode="before")
    @classmethod
    def _level(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    @field_validator("workers", mode="before")
    @classmethod
    def _workers(cls, value: Any) -> Any:
        return json.loads(value) if isinstance(value, str) else value  # KVPOOL_WORKERS is JSON

    @model_validator(mode="before")
    @classmethod
    def _short_names(cls, values: Any) -> Any:
        if not isinstance(values, dict):
            return values
        out: dict[str, Any] = {}
        flat: dict[str, Any] = {}
        for key, value in values.items():
            if key in cls.model_fields:
                out[key] = dict(value) if isinstance(value, dict) else value
            elif key in SHORT_NAMES:
                flat[key] = value
            else:
                raise ValueError(f"unknown setting {key!r}{hint(key)}")
        for key, value in flat.items():  # a short name wins over its section's entry, as a flag would
            section = SHORT_NAMES[key]
            out.setdefault(section, {})
            if isinstance(out[section], BaseModel):
                out[section] = out[section].model_dump()
            out[section][key] = value
        return out

    def source(self, path: str) -> str:
        """Where the value of `path` ("section.field", or a root field) came from: "default",
        "file PATH", "environment VAR", "flag" or "flag --set" (as `load_settings` saw it)."""
        return self._sources.get(path, "default")

    def sources(self) -> dict[str, str]:
        """Every value that is not a default, by path, with its origin."""
        return dict(self._sources)

    def redacted(self) -> dict[str, Any]:
        """The tree as plain data, each secret that is set shown as "<redacted>"."""
        doc = self.model_dump(mode="json")
        for name, section in SECTIONS.items():
            for secret in section.SECRETS:
                if doc[name].get(secret) is not None:
                    doc[name][secret] = "<redacted>"
        return doc


SHORT_NAMES: dict[str, str] = {}  # short field name -> its section (`SHORT_ENV` sections)
for _name, _section in SECTIONS.items():
    if _section.SHORT_ENV:
        for _field in _section.model_fields:
            if _field in SHORT_NAMES:  # KVPOOL_<FIELD> must name one field
                raise TypeError(f"{_field} is in two short-named sections")
            SHORT_NAMES[_field] = _name


def hint(key: str, section: str | None = None) -> str:
    """Where a misplaced or misspelt key belongs, for an error message ("" when nothing fits)."""
    import difflib

    homes = [name for name, sec in SECTIONS.items() if key in sec.model_fields and name != section]
    if homes:
        return f" (it belongs in [{homes[0]}])"
    known = list(SECTIONS[section].model_fields) if section else [*Settings.model_fields, *SHORT_NAMES]
    close = difflib.get_close_matches(key, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def default(path: str) -> Any:
    """The default of a field, "section.field" (for code that must agree with the tree without
    loading one: a library config's own defaults)."""
    section, _, name = path.partition(".")
    info = SECTIONS[section].model_fields[name]
    return info.get_default(call_default_factory=True)
