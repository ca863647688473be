"""`fp8`: float8 e4m3 (torch.float8_e4m3fn), K scaled per channel and V per token
(`kvpool.codec.scaled`).

y = x / s with s = amax / 448 over the group (bfloat16, rounded up), so |y| <= 448, the largest
e4m3 value; the code is y rounded to nearest even with 3 mantissa bits; x^ = code * s.
Bound: |x^ - x| <= |x| / 16 (normal codes, |y| >= 2^-6) or s / 1024 (subnormal codes), plus the
rounding of x^ into the layout dtype. e4m3 spends its bits on relative precision, int8 on absolute
precision within the group: which agrees better with the uncompressed model is measured by
`kvpool bench codec`.
"""

from __future__ import annotations

import torch

from kvpool.codec.scaled import ScaledCodec
from kvpool.errors import FormatError

E4M3 = torch.float8_e4m3fn
_MAX = float(torch.finfo(E4M3).max)  # 448


class Fp8Codec(ScaledCodec):
    name = "fp8"
    codec_id = 2
    qmax = _MAX
    code_dtype = E4M3

    def _to_codes(self, y: torch.Tensor) -> torch.Tensor:
        return y.clamp_(-_MAX, _MAX).to(E4M3)

    def _codes_float(self, codes: torch.Tensor) -> torch.Tensor:
        # torch's own float8 -> float32 conversion is scalar on CPU (~5x slower than this): place the
        # code's 7 exponent+mantissa bits at float32's mantissa top, keep the sign, and multiply by
        # 2^(127 - 7) to move e4m3's exponent bias to float32's (subnormal codes land exactly too)
        bits = codes.view(torch.int8).to(torch.int32)  # sign-extended: bit 31 is the code's sign
        magnitude = bits & 0x7F
        if bool((magnitude == 0x7F).any()):  # e4m3fn's NaNs (0x7f, 0xff): the encoder never writes them
            raise FormatError("damaged fp8 payload: a code is NaN")
        sign = bits.bitwise_and_(-(2**31))
        return magnitude.bitwise_left_shift_(20).bitwise_or_(sign).view(torch.float32).mul_(2.0**120)

    def _code_error(self, y_abs: torch.Tensor) -> torch.Tensor:
        return torch.maximum(y_abs * 2.0**-4, torch.full_like(y_abs, 2.0**-10))
