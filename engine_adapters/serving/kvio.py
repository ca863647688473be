"""KV as chunks: conversions between a transformers `DynamicCache` and chunk tensors (reads from
the pool go through the adapters' one reader, `engine_adapters.chunk_reader`; writes through
`HFAdapter.save`).

A chunk tensor is `[layers, 2, kv_heads, tokens, head_dim]` (K then V per layer), the same order
as a chunk object's payload (`kvpool.chunk_format`), so encoding is one copy and decoding none.

The workers need chunk granularity (not whole-prefix loads) because their own prefix cache sits
in front of the pool: they fetch only the chunks they do not already hold.

Invariant: `cache_from_chunks` never aliases its inputs: the cache it builds owns fresh tensors,
so a model step that appends to it cannot write into a shared chunk.
"""

from __future__ import annotations

from typing import Any, Sequence


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
