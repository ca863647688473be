"""The reference worker's configuration (`WorkerConfig`), checked when it is made; its defaults
are the tree's (`kvpool.config`, `[worker]` and `[pool]`), and `from_settings` makes one from it."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.codec import get_codec
from kvpool.config import Settings, default
from kvpool.errors import InvalidArgument

ROLES = ("prefill", "decode", "both")
NO_POOL = "none"  # `pool`: a plain engine that shares nothing (the baseline of what the pool costs)


@dataclass
class WorkerConfig:
    role: str = "both"
    pool: str = default("pool.master")  # NO_POOL: none (no reuse across workers, nothing stored)
    chunk_tokens: int = default("pool.chunk_tokens")
    local_cache_bytes: int = default("worker.local_cache")
    max_batch: int = default("worker.max_batch")
    max_kv_tokens: int | None = default("worker.max_kv_tokens")  # KV the decode batch may hold (~3 GiB in float32 here)
    # None: whole prompt in one pass. Defaults to 512 where decode runs (`both`, and `decode`, which
    # prefills the short prompts a router sends it): decode priority needs gaps.
    prefill_chunk_tokens: int | None = None
    tenant_salt: str = ""
    # how KV chunks are stored in the pool (kvpool.codec); part of the namespace, so a worker only
    # ever reads chunks of its own codec; lossy codecs are opt-in
    kv_codec: str = default("pool.kv_codec")

    @classmethod
    def from_settings(cls, settings: Settings, role: str) -> "WorkerConfig":
        w, pool = settings.worker, settings.pool
        return cls(role=role, pool=w.pool or pool.master, chunk_tokens=pool.chunk_tokens,
                   local_cache_bytes=w.local_cache, max_batch=w.max_batch, max_kv_tokens=w.max_kv_tokens or None,
                   prefill_chunk_tokens=w.prefill_chunk_tokens, tenant_salt=settings.security.tenant_salt or "",
                   kv_codec=pool.kv_codec)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise InvalidArgument(f"role must be one of {ROLES}, got {self.role!r}")
        get_codec(self.kv_codec)  # an unknown name is InvalidArgument now, not at the first save
        if self.pool == NO_POOL and self.role != "both":
            raise InvalidArgument("a worker without a pool can only be colocated (role both): prefill and decode "
                                  "workers hand KV over through the pool")
        if self.prefill_chunk_tokens is None and self.role in ("both", "decode"):
            self.prefill_chunk_tokens = 512
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens <= 0:
            self.prefill_chunk_tokens = None
