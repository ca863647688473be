"""KV as chunks: conversions between a transformers `DynamicCache` and chunk tensors, and
chunk-granular reads from the pool (writes go through the adapter, `HFAdapter.save`).

A chunk tensor is `[layers, 2, kv_heads, tokens, head_dim]` (K then V per layer), the same order
as a chunk object's payload (`kvpool.layout`), so encoding is one copy and decoding none.

The workers need chunk granularity (not whole-prefix loads) because their own prefix cache sits
in front of the pool: they fetch only the chunks they do not already hold.

Invariants:
- `fetch_run` returns the tensors of keys[0..n) for the longest run the pool serves intact. A
  chunk that fails its checksum or layout check ends the run like a miss: it is logged, counted,
  and removed from the pool so a fresh computation can replace it (chunk keys are content
  addressed and the first writer wins, so a damaged copy would otherwise stay forever).
- `cache_from_chunks` never aliases its inputs: the cache it builds owns fresh tensors, so a
  model step that appends to it cannot write into a shared chunk.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, Sequence

from kvpool.errors import CorruptObject, KeyNotFound, KVPoolError, LayoutMismatch
from kvpool.layout import KVLayout, decode_chunk

log = logging.getLogger(__name__)


def cache_from_chunks(chunks: Sequence[Any], num_tokens: int | None = None):
    """A `DynamicCache` (batch 1) holding the concatenation of `chunks`, cut to `num_tokens`."""
    import torch
    from transformers import DynamicCache

    if not chunks:
        return DynamicCache()
    layers = chunks[0].shape[0]
    total = sum(int(c.shape[3]) for c in chunks)
    keep = total if num_tokens is None else num_tokens
    data = []
    for layer in range(layers):
        # torch.cat always allocates, so the cache never shares storage with the chunks
        k = torch.cat([c[layer, 0] for c in chunks], dim=1)[:, :keep].contiguous().unsqueeze(0)
        v = torch.cat([c[layer, 1] for c in chunks], dim=1)[:, :keep].contiguous().unsqueeze(0)
        data.append((k, v))
    return DynamicCache(ddp_cache_data=data)


def cache_tokens(cache) -> int:
    return int(cache.get_seq_length()) if cache is not None else 0


def chunk_from_cache(cache, start: int, end: int):
    """Tokens [start, end) of `cache` as one contiguous chunk tensor (a copy)."""
    import torch

    return torch.stack([torch.stack((layer.keys[0, :, start:end], layer.values[0, :, start:end]))
                        for layer in cache.layers]).contiguous()


def chunks_from_cache(cache, start_chunk: int, end_chunk: int, chunk_tokens: int) -> list[Any]:
    return [chunk_from_cache(cache, i * chunk_tokens, (i + 1) * chunk_tokens) for i in range(start_chunk, end_chunk)]


class PoolKV:
    """Chunk-granular access to the pool for one KV layout (any `kvpool.api.PoolClient`)."""

    def __init__(self, pool: Any, layout: KVLayout, batch_bytes: int = 48 << 20):
        self.pool = pool
        self.layout = layout
        # Reads go in batches of about `batch_bytes`: one round trip for many small chunks, but
        # not more at once than a node can stage through its DRAM (see `_get`).
        self.batch_chunks = max(1, batch_bytes // layout.object_nbytes())
        self.corrupt_chunks = 0
        self.fetched_chunks = 0
        self.on_removed = None  # callback(key) after a damaged object was dropped from the pool

    def match(self, keys: Sequence[str]) -> int:
        return int(self.pool.match_prefix(list(keys))) if keys else 0

    def _get(self, keys: Sequence[str]) -> Iterator[tuple[str, Any]]:
        """(key, bytes or None) in order, in batches of `batch_chunks`; a batch miss is retried
        once alone, because a node may decline a large batch it cannot stage all at once (SSD
        objects are promoted through DRAM) while serving the same objects one by one."""
        for start in range(0, len(keys), self.batch_chunks):
            group = list(keys[start:start + self.batch_chunks])
            for key, blob in zip(group, self.pool.get_batch(group)):
                if blob is None and len(group) > 1:
                    blob = self.pool.get(key)
                yield key, blob
                if blob is None:
                    return

    def fetch_run(self, keys: Sequence[str]) -> list[Any]:
        """Chunk tensors of the longest intact run keys[0..n) in the pool."""
        run = []
        for key, blob in self._get(keys):
            if blob is None:
                break
            tensor = self._decode(key, blob)
            if tensor is None:
                break
            if int(tensor.shape[3]) != self.layout.chunk_tokens:
                log.warning("chunk %s holds %d tokens, not a full chunk; treating it as a miss", key, tensor.shape[3])
                break
            run.append(tensor)
        self.fetched_chunks += len(run)
        return run

    def fetch_exact(self, keys: Sequence[str], tokens: Sequence[int]):
        """Chunk tensors of every key, each holding the given token count; all or nothing.

        Raises `KeyNotFound` when an object is gone and `CorruptObject` when one is damaged (it
        is dropped from the pool too): the caller cannot continue without it.
        """
        out = []
        for (key, blob), want in zip(self._get(keys), tokens):
            if blob is None:
                raise KeyNotFound(f"KV object {key} is not in the pool (evicted, expired or released)")
            tensor = self._decode(key, blob)
            if tensor is None:
                raise CorruptObject(f"KV object {key} was damaged or of another layout; it has been dropped")
            if int(tensor.shape[3]) != want:
                raise CorruptObject(f"KV object {key} holds {tensor.shape[3]} tokens, expected {want}")
            out.append(tensor)
        self.fetched_chunks += len(out)
        return out

    def remove(self, key: str) -> None:
        try:
            # Our own read of the object holds a lease that would defer the removal (and make the
            # re-store of a good copy find the key busy); the client releases leases lazily.
            flush = getattr(self.pool, "flush", None)
            if flush is not None:
                flush()
            self.pool.remove(key)
        except KVPoolError as exc:  # best effort: the tail's lease reclaims it anyway
            log.warning("could not remove %s from the pool: %s", key, exc)

    def _decode(self, key: str, blob: Any):
        try:
            return decode_chunk(blob, self.layout).as_torch()
        except LayoutMismatch:
            log.warning("chunk %s was written for another layout; treating it as a miss", key)
            return None
        except CorruptObject as exc:
            self.corrupt_chunks += 1
            log.warning("chunk %s failed its check (%s); dropping it from the pool and recomputing", key, exc)
            self.remove(key)
            if self.on_removed is not None:
                self.on_removed(key)
            return None
