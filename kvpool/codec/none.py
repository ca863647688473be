"""`none`: the payload is the KV's own bytes, layer-major (the chunk format's plain payload).

Round trip: bit-exact. Size: `layout.payload_nbytes(tokens)`.
"""

from __future__ import annotations

from typing import Any

import torch

from kvpool.codec._tensors import byte_view, check_kv, payload_view, torch_dtype
from kvpool.chunk_format import KVLayout


class NoneCodec:
    name = "none"
    codec_id = 0
    lossless = True
    fixed_rate = True

    def max_encoded_nbytes(self, layout: KVLayout, tokens: int) -> int:
        return layout.payload_nbytes(tokens)

    def encode_into(self, layout: KVLayout, kv: Any, out: Any) -> int:
        tokens = check_kv(layout, kv)
        n = layout.payload_nbytes(tokens)
        dst = byte_view(out, n).view(torch_dtype(layout)).view(layout.shape(tokens))
        dst.copy_(kv)
        return n

    def decode_into(self, layout: KVLayout, payload: Any, out: Any) -> None:
        tokens = check_kv(layout, out, "out")
        raw = payload_view(payload, layout.payload_nbytes(tokens), self.name, tokens)
        out.copy_(raw.view(torch_dtype(layout)).view(layout.shape(tokens)))

    def error_bound(self, layout: KVLayout, kv: Any) -> torch.Tensor:
        check_kv(layout, kv)
        return torch.zeros(kv.shape, dtype=torch.float64)
