"""One sequence's KV cache: a tensor in the pool's chunk layout, grown in place.

`SequenceKV.data` is `[layers, 2, kv_heads, capacity, head_dim]` (K then V per layer), the order
of a chunk object's payload (`kvpool.chunk_format`) and of the workers' chunk tensors, so a chunk
goes in or out with one copy of a slice and no transpose. Tokens `[0, length)` are valid; the
model runner writes the next ones at `length` and only then advances it.

Invariants:
- `length <= capacity`; `reserve` grows the capacity (one copy of the valid tokens, doubling, so
  a sequence that grows one token a step copies its KV O(log n) times, not once a step).
- Nothing a caller holds aliases `data`: `from_chunks` copies the chunks in, `chunk` copies out.
  A chunk tensor handed to the local prefix cache or the pool is never written afterwards.
- Only the engine thread writes a sequence's KV once it is submitted, and only appends: tokens
  before `length` never change. Another thread may read those (to save a prompt's KV to the pool
  while its decode goes on) once the engine has computed them (the prefill's future resolved).
"""

from __future__ import annotations

from typing import Sequence

import torch

MIN_CAPACITY = 64


class SequenceKV:
    def __init__(self, shape: tuple[int, int, int], dtype: torch.dtype, capacity: int = MIN_CAPACITY):
        """`shape`: (layers, kv_heads, head_dim)."""
        layers, heads, head_dim = shape
        self.data = torch.empty((layers, 2, heads, max(capacity, 1), head_dim), dtype=dtype)
        self.length = 0

    @classmethod
    def from_chunks(cls, chunks: Sequence[torch.Tensor], num_tokens: int, capacity: int = 0) -> "SequenceKV":
        """A cache holding the first `num_tokens` tokens of the concatenated chunks (each
        `[layers, 2, kv_heads, tokens, head_dim]`), with room for `capacity` tokens in all."""
        if not chunks:
            raise ValueError("from_chunks needs at least one chunk")
        first = chunks[0]
        layers, _, heads, _, head_dim = first.shape
        kv = cls((layers, heads, head_dim), first.dtype, max(capacity, num_tokens, MIN_CAPACITY))
        start = 0
        for c in chunks:
            take = min(int(c.shape[3]), num_tokens - start)
            if take <= 0:
                break
            kv.data[:, :, :, start:start + take].copy_(c[:, :, :, :take])
            start += take
        if start < num_tokens:
            raise ValueError(f"the chunks hold {start} tokens, fewer than the {num_tokens} asked for")
        kv.length = num_tokens
        return kv

    @property
    def capacity(self) -> int:
        return int(self.data.shape[3])

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def reserve(self, tokens: int) -> None:
        """Room for `tokens` tokens in all (at least doubling when it must grow)."""
        if tokens <= self.capacity:
            return
        old = self.data
        new = old.new_empty((*old.shape[:3], max(tokens, 2 * self.capacity), old.shape[4]))
        new[:, :, :, :self.length].copy_(old[:, :, :, :self.length])
        self.data = new  # filled first: a reader sees the old tensor or the whole new one

    def clone(self) -> "SequenceKV":
        """An independent copy (same capacity and length)."""
        out = SequenceKV.__new__(SequenceKV)
        out.data, out.length = self.data.clone(), self.length
        return out

    def chunk(self, start: int, end: int) -> torch.Tensor:
        """Tokens `[start, end)` as a new contiguous `[layers, 2, kv_heads, end - start, head_dim]`."""
        if not 0 <= start <= end <= self.length:
            raise ValueError(f"tokens [{start}, {end}) are outside the cache's [0, {self.length})")
        # one read of `data` (a concurrent `reserve` swaps it for a copy); a contiguous copy out
        return self.data[:, :, :, start:end].clone(memory_format=torch.contiguous_format)

    def chunks(self, first: int, last: int, chunk_tokens: int) -> list[torch.Tensor]:
        """Full chunks `first..last-1` (chunk i is tokens `[i*c, (i+1)*c)`)."""
        return [self.chunk(i * chunk_tokens, (i + 1) * chunk_tokens) for i in range(first, last)]

    def layers(self, end: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(K, V) per layer of tokens `[0, end)` (default: all), `[kv_heads, end, head_dim]` views:
        what an adapter's `save` reads."""
        n = self.length if end is None else end
        if not 0 <= n <= self.length:
            raise ValueError(f"tokens [0, {n}) are outside the cache's [0, {self.length})")
        data = self.data  # one read: a concurrent `reserve` swaps it for a copy
        return [(data[i, 0, :, :n], data[i, 1, :, :n]) for i in range(data.shape[0])]
