"""KV as chunks: conversions between a transformers `DynamicCache` and chunk tensors (reads from
the pool go through the adapters' one reader, `engine_adapters.chunk_reader`; writes through
`HFAdapter.save`).

A chunk tensor is `[layers, 2, kv_heads, tokens, head_dim]` (K then V per layer), the same order
as a chunk object's payload (`kvpool.chunk_format`), so encoding is one copy and decoding none.

The workers need chunk granularity (not whole-prefix loads) because their own prefix cache sits
in front of the pool: they fetch only the chunks they do not already hold.

Invariant: `cache_from_chunks` never aliases its inputs: the cache it builds owns fresh tensors,
so a model step that appends to it cannot write into a shared chunk.

No copy that is not needed: appending to a transformers cache layer concatenates (a copy of the
layer's whole KV), so a cache built from chunks does not assemble them first (a second copy of
the prefix, ~80 MB for 1,792 tokens of the reference model). Each layer keeps its chunks' slices
(`ChunkedLayer`) and concatenates them together with the first tokens the model appends to it:
the prefix is copied once, in the forward, layer by layer, as an engine that already held it
would copy it.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence


def cache_from_chunks(chunks: Sequence[Any], num_tokens: int | None = None):
    """A `DynamicCache` (batch 1) holding the concatenation of `chunks`, cut to `num_tokens`; each
    layer a `ChunkedLayer` (concatenated at its first append, or when first read)."""
    from transformers import DynamicCache

    if not chunks:
        return DynamicCache()
    layers = chunks[0].shape[0]
    total = sum(int(c.shape[3]) for c in chunks)
    keep = total if num_tokens is None else num_tokens
    pieces, left = [], keep
    for c in chunks:  # the chunks (or the first part of one) that hold tokens [0, keep)
        if left <= 0:
            break
        pieces.append(c[:, :, :, :left] if int(c.shape[3]) > left else c)
        left -= int(c.shape[3])
    cache = DynamicCache()
    cache.layers = [chunked_layer_type()([p[layer, 0] for p in pieces], [p[layer, 1] for p in pieces], keep)
                    for layer in range(layers)]
    return cache


@functools.cache
def chunked_layer_type() -> type:
    """`ChunkedLayer` (defined on first use: transformers is imported only when a cache is built)."""
    from transformers.cache_utils import DynamicLayer

    class ChunkedLayer(DynamicLayer):
        """A cache layer holding its KV as the chunks' slices (`[kv_heads, tokens, head_dim]` each),
        not yet concatenated. The first `update` concatenates them with the appended tokens in one
        `torch.cat` (what a plain `DynamicLayer` does with its single tensor); reading `keys` or
        `values` before that concatenates them alone. Either way the layer then owns fresh
        tensors and never writes into a chunk."""

        def __init__(self, keys: list[Any], values: list[Any], num_tokens: int):
            super().__init__()
            del self.keys, self.values  # read through __getattr__ until joined
            self._pending: tuple[list[Any], list[Any]] | None = (keys, values)
            self._pending_tokens = num_tokens
            self.device = keys[0].device
            self.is_initialized = True

        def _join(self, extra_k: Any = None, extra_v: Any = None) -> None:
            import torch

            keys, values = self._pending
            self._pending = None
            tail_k = [] if extra_k is None else [extra_k]
            tail_v = [] if extra_v is None else [extra_v]
            # torch.cat always allocates, so the layer never shares storage with the chunks
            self.__dict__["keys"] = torch.cat([k.unsqueeze(0) for k in keys] + tail_k, dim=-2)
            self.__dict__["values"] = torch.cat([v.unsqueeze(0) for v in values] + tail_v, dim=-2)

        def update(self, key_states, value_states, *args, **kwargs):
            if self._pending is None:
                return super().update(key_states, value_states, *args, **kwargs)
            self._join(key_states, value_states)
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self._pending_tokens if self._pending is not None else super().get_seq_length()

        def __getattr__(self, name: str) -> Any:  # `keys` / `values` read while still pending
            if name in ("keys", "values") and self.__dict__.get("_pending") is not None:
                self._join()
                return self.__dict__[name]
            raise AttributeError(name)

    return ChunkedLayer


def chunk_from_cache(cache, start: int, end: int):
    """Tokens [start, end) of `cache` as one contiguous chunk tensor (one copy, straight into place)."""
    import torch

    first = cache.layers[0].keys
    out = torch.empty((len(cache.layers), 2, first.shape[1], end - start, first.shape[3]), dtype=first.dtype,
                      device=first.device)
    for i, layer in enumerate(cache.layers):
        out[i, 0].copy_(layer.keys[0, :, start:end])
        out[i, 1].copy_(layer.values[0, :, start:end])
    return out


def chunks_from_cache(cache, start_chunk: int, end_chunk: int, chunk_tokens: int) -> list[Any]:
    return [chunk_from_cache(cache, i * chunk_tokens, (i + 1) * chunk_tokens) for i in range(start_chunk, end_chunk)]
