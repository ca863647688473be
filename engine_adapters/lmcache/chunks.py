"""`LMCacheChunks`: LMCache's KV chunks as kvpool chunk objects, with no LMCache import.

LMCache holds a chunk as one tensor in its KV_2LTD format, `[2, layers, tokens, heads * head_dim]`
(K then V, each layer by layer). A kvpool chunk object's payload is layer-major,
`[layers, 2, heads, tokens, head_dim]` (`kvpool.chunk_format`). Both directions are one strided
copy (the permutation swaps the first two and the middle two dimensions, so it is its own
inverse): `encode` copies straight into the object's payload and seals the header, `place` copies
a verified view straight into the tensor LMCache allocated.
"""

from __future__ import annotations

from typing import Any

import torch

from kvpool.chunk_format import ChunkAuth, ChunkView, KVLayout, payload_tensor, seal_into
from kvpool.errors import InvalidArgument
from kvpool.keys import Namespace

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_SWAP = (1, 0, 3, 2, 4)  # [2, L, T, H, D] <-> [L, 2, H, T, D]
KEY_PREFIX = "lmcache/"


class LMCacheChunks:
    """Chunk objects of one LMCache engine's namespace. Invariant: `encode(kv, k)` and a verified
    view of what it returns give back `kv` bit for bit through `place`."""

    def __init__(self, namespace: Namespace, mac_key: bytes | None = None):
        self.namespace = namespace
        self.layout: KVLayout = namespace.layout
        self.auth = ChunkAuth(namespace.digest(), mac_key)
        self.dtype = TORCH_DTYPES[self.layout.dtype]
        self.prefix = f"{KEY_PREFIX}{namespace.hex()}/"

    def pool_key(self, key_string: str) -> str:
        """The pool key of an LMCache key (`CacheEngineKey.to_string()`)."""
        return self.prefix + key_string

    def shape(self, tokens: int) -> torch.Size:
        """LMCache's KV_2LTD shape of a chunk of `tokens` tokens."""
        lay = self.layout
        return torch.Size([2, lay.num_layers, tokens, lay.kv_heads * lay.head_dim])

    def _tokens_of(self, kv: torch.Tensor) -> int:
        lay = self.layout
        if kv.dim() != 4 or kv.shape[0] != 2 or kv.shape[1] != lay.num_layers or kv.shape[3] != lay.kv_heads * lay.head_dim:
            raise InvalidArgument(f"LMCache chunk of shape {tuple(kv.shape)} is not [2, {lay.num_layers}, tokens, "
                                  f"{lay.kv_heads * lay.head_dim}] (KV_2LTD of this model)")
        if kv.dtype != self.dtype:
            raise InvalidArgument(f"LMCache chunk of dtype {kv.dtype}, the namespace's layout is {self.layout.dtype}")
        tokens = int(kv.shape[2])
        if not 0 < tokens <= lay.chunk_tokens:
            raise InvalidArgument(f"LMCache chunk of {tokens} tokens; chunks hold 1..{lay.chunk_tokens}")
        return tokens

    def encode(self, kv: torch.Tensor, pool_key: str, out: Any = None) -> memoryview:
        """A chunk object holding `kv` (KV_2LTD), bound to `pool_key`: one copy, then the header.
        Written into `out` (a writable buffer, reused by a caller that puts in batches: fresh memory
        costs a page fault per 4 KiB) when given, else into a new buffer; returns the object's bytes."""
        tokens = self._tokens_of(kv)
        lay = self.layout
        nbytes = lay.object_nbytes(tokens)
        out = bytearray(nbytes) if out is None else out
        if len(memoryview(out).cast("B")) < nbytes:
            raise InvalidArgument(f"buffer of {len(memoryview(out).cast('B'))} B, the chunk object needs {nbytes}")
        payload_tensor(out, lay, tokens).copy_(self._as_5d(kv, tokens).permute(_SWAP))
        seal_into(out, lay, tokens, key=pool_key, auth=self.auth)
        return memoryview(out).cast("B")[:nbytes]

    def place(self, view: ChunkView, dst: torch.Tensor) -> None:
        """Copy a verified chunk into `dst`, LMCache's KV_2LTD tensor of `view.tokens` tokens."""
        if self._tokens_of(dst) != view.tokens:
            raise InvalidArgument(f"destination holds {dst.shape[2]} tokens, the chunk {view.tokens}")
        self._as_5d(dst, view.tokens).copy_(view.as_torch().permute(_SWAP))

    def _as_5d(self, kv: Any, tokens: int) -> torch.Tensor:
        lay = self.layout
        return kv.view(2, lay.num_layers, tokens, lay.kv_heads, lay.head_dim)
