"""`int8`: symmetric 8-bit integers, K scaled per channel and V per token (`kvpool.codec.scaled`).

q = round(x / s) in -127..127, s = amax / 127 over the group (bfloat16, rounded up); x^ = q * s.
Bound: |x^ - x| <= s / 2, plus the rounding of x^ into the layout dtype.
"""

from __future__ import annotations

import torch

from kvpool.codec.scaled import ScaledCodec


class Int8Codec(ScaledCodec):
    name = "int8"
    codec_id = 1
    qmax = 127.0
    code_dtype = torch.int8

    def _to_codes(self, y: torch.Tensor) -> torch.Tensor:
        return y.round_().clamp_(-self.qmax, self.qmax)

    def _code_error(self, y_abs: torch.Tensor) -> torch.Tensor:
        return torch.full_like(y_abs, 0.5)
