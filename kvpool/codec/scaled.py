"""The 8-bit scaled codecs, `int8` and `fp8`: K scaled per channel, V scaled per token (KIVI's split).

K has a few channels with large magnitudes in every token (the rotary outliers), so one scale per
(layer, head, channel) over the chunk's tokens keeps the small channels precise; V has no such
channels and its error mixes across channels in attention, so one scale per (layer, head, token)
over head_dim. Scales are bfloat16 (float32's range in 2 bytes), rounded *up* so every |x| / s
is within the code's range, and s = 0 for an all-zero group (decodes to exact zeros).

Payload, layer-major (layer i is the slice [i * layer_nbytes, (i + 1) * layer_nbytes)):

    codes   [2, kv_heads, tokens, head_dim]   1 byte each (K then V)
    k scale [kv_heads, head_dim]              bfloat16
    v scale [kv_heads, tokens]                bfloat16

A 256-token chunk of SmolLM2 (3 heads, head dim 64): 1 + 1/256 + 1/64 bytes per value, i.e.
0.510x of bfloat16 and 0.255x of float32.
"""

from __future__ import annotations

from typing import Any

import torch

from kvpool.codec._tensors import SUBNORMAL_HALF_STEP, UNIT_ROUNDOFF, byte_view, check_kv, payload_view
from kvpool.errors import FormatError, InvalidArgument
from kvpool.chunk_format import KVLayout

SCALE_DTYPE = torch.bfloat16
_FP16_MAX = float(torch.finfo(torch.float16).max)
_TINY = 1e-30  # absolute slack of the bounds: float32 underflow of amax / qmax


def layer_nbytes(layout: KVLayout, tokens: int) -> int:
    h, d = layout.kv_heads, layout.head_dim
    return 2 * h * tokens * d + 2 * h * d + 2 * h * tokens


def stored_scales(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """bfloat16 scales >= amax / qmax (the next bfloat16 up where rounding went down)."""
    s = amax / qmax
    stored = s.to(SCALE_DTYPE)
    low = stored.to(torch.float32) < s
    if bool(low.any()):  # positive bfloat16 values order like their bit patterns: +1 is the next one
        stored = torch.where(low, (stored.view(torch.int16) + 1).view(SCALE_DTYPE), stored)
    if not bool(torch.isfinite(stored).all()):
        raise InvalidArgument("KV holds non-finite values (or values beyond bfloat16's range): not encodable")
    return stored


class ScaledCodec:
    """The shared scheme; a subclass names its code type and how a float becomes a code."""

    name: str
    codec_id: int
    lossless = False
    fixed_rate = True
    qmax: float
    code_dtype: torch.dtype

    def max_encoded_nbytes(self, layout: KVLayout, tokens: int) -> int:
        return layout.num_layers * layer_nbytes(layout, tokens)

    # -- subclass hooks ---------------------------------------------------------------------------

    def _to_codes(self, y: torch.Tensor) -> torch.Tensor:
        """`y` (float32, |y| <= qmax up to rounding, may be modified) as codes of `code_dtype`."""
        raise NotImplementedError

    def _codes_float(self, codes: torch.Tensor) -> torch.Tensor:
        """The codes' values as a new float32 tensor; `FormatError` for codes the encoder never writes."""
        return codes.to(torch.float32)

    def _code_error(self, y_abs: torch.Tensor) -> torch.Tensor:
        """Bound on |code(y) - y| in units of the scale (float64)."""
        raise NotImplementedError

    # -- payload views ----------------------------------------------------------------------------

    def _split(self, buf: torch.Tensor, layout: KVLayout, tokens: int):
        """(codes [L, 2, H, T, D], k scales [L, H, 1, D], v scales [L, H, T, 1]) over a [L, layer] view."""
        nl, h, d = layout.num_layers, layout.kv_heads, layout.head_dim
        ncodes = 2 * h * tokens * d
        codes = buf[:, :ncodes].view(self.code_dtype).view(nl, 2, h, tokens, d)
        ks = buf[:, ncodes:ncodes + 2 * h * d].view(SCALE_DTYPE).view(nl, h, 1, d)
        vs = buf[:, ncodes + 2 * h * d:].view(SCALE_DTYPE).view(nl, h, tokens, 1)
        return codes, ks, vs

    # -- the codec --------------------------------------------------------------------------------

    def encode_into(self, layout: KVLayout, kv: Any, out: Any) -> int:
        tokens = check_kv(layout, kv)
        n = self.max_encoded_nbytes(layout, tokens)
        buf = byte_view(out, n).view(layout.num_layers, -1)
        codes, ks_out, vs_out = self._split(buf, layout, tokens)
        x = kv.to(torch.float32)  # the same tensor for float32 input: only read below
        k, v = x[:, 0], x[:, 1]
        ks = stored_scales(k.abs().amax(dim=2, keepdim=True), self.qmax)
        vs = stored_scales(v.abs().amax(dim=3, keepdim=True), self.qmax)
        for part, scale, dst in ((k, ks, codes[:, 0]), (v, vs, codes[:, 1])):
            divisor = scale.to(torch.float32)
            divisor = torch.where(divisor > 0, divisor, torch.ones_like(divisor))
            dst.copy_(self._to_codes(part / divisor))
        ks_out.copy_(ks)
        vs_out.copy_(vs)
        return n

    @staticmethod
    def _scales(scale: torch.Tensor, what: str) -> torch.Tensor:
        s = scale.to(torch.float32)
        if not bool(torch.isfinite(s).all()) or bool((s < 0).any()):
            raise FormatError(f"damaged payload: a {what} scale is negative or not finite")
        return s

    def _dequantize(self, codes: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
        y = self._codes_float(codes).mul_(scale)
        if out.dtype == torch.float16:  # q * s may round just past float16's largest value
            y.clamp_(-_FP16_MAX, _FP16_MAX)
        out.copy_(y)

    def decode_into(self, layout: KVLayout, payload: Any, out: Any) -> None:
        tokens = check_kv(layout, out, "out")
        per = layer_nbytes(layout, tokens)
        buf = payload_view(payload, layout.num_layers * per, self.name, tokens).view(layout.num_layers, per)
        codes, ks, vs = self._split(buf, layout, tokens)
        k_scale, v_scale = self._scales(ks, "K"), self._scales(vs, "V")
        self._dequantize(codes[:, 0], k_scale, out[:, 0])
        self._dequantize(codes[:, 1], v_scale, out[:, 1])

    def error_bound(self, layout: KVLayout, kv: Any) -> torch.Tensor:
        """|x^ - x| <= s * code_error(|x| / s) + u * (|x| + that) + slack, where s is the group's
        stored scale, u the layout dtype's unit roundoff (the final rounding into it, half a subnormal
        step below its normal range) and the slack float32 arithmetic (2^-22 relative, 1e-30 absolute)."""
        check_kv(layout, kv)
        x = kv.to(torch.float64)
        k_abs, v_abs = x[:, 0].abs(), x[:, 1].abs()
        ks = stored_scales(kv[:, 0].to(torch.float32).abs().amax(dim=2, keepdim=True), self.qmax).to(torch.float64)
        vs = stored_scales(kv[:, 1].to(torch.float32).abs().amax(dim=3, keepdim=True), self.qmax).to(torch.float64)
        bound = torch.empty_like(x)
        u, floor = UNIT_ROUNDOFF[layout.dtype], SUBNORMAL_HALF_STEP[layout.dtype] + _TINY
        for part, x_abs, s in ((0, k_abs, ks), (1, v_abs, vs)):
            y_abs = x_abs / torch.where(s > 0, s, torch.ones_like(s))
            err = s * self._code_error(y_abs)
            bound[:, part] = err + u * (x_abs + err) + x_abs * 2.0**-22 + floor
        return bound


class Int8Codec(ScaledCodec):
    """`int8`: q = round(x / s) in -127..127, s = amax / 127 over the group (bfloat16, rounded up);
    x^ = q * s. Bound: |x^ - x| <= s / 2, plus the rounding of x^ into the layout dtype."""

    name = "int8"
    codec_id = 1
    qmax = 127.0
    code_dtype = torch.int8

    def _to_codes(self, y: torch.Tensor) -> torch.Tensor:
        return y.round_().clamp_(-self.qmax, self.qmax)

    def _code_error(self, y_abs: torch.Tensor) -> torch.Tensor:
        return torch.full_like(y_abs, 0.5)


E4M3 = torch.float8_e4m3fn
_E4M3_MAX = float(torch.finfo(E4M3).max)  # 448


class Fp8Codec(ScaledCodec):
    """`fp8`: float8 e4m3 (torch.float8_e4m3fn). y = x / s with s = amax / 448 over the group
    (bfloat16, rounded up), so |y| <= 448, the largest e4m3 value; the code is y rounded to nearest
    even with 3 mantissa bits; x^ = code * s. Bound: |x^ - x| <= |x| / 16 (normal codes,
    |y| >= 2^-6) or s / 1024 (subnormal codes), plus the rounding of x^ into the layout dtype.
    e4m3 spends its bits on relative precision, int8 on absolute precision within the group:
    which agrees better with the uncompressed model is measured by `kvpool bench codec`."""

    name = "fp8"
    codec_id = 2
    qmax = _E4M3_MAX
    code_dtype = E4M3

    def _to_codes(self, y: torch.Tensor) -> torch.Tensor:
        return y.clamp_(-_E4M3_MAX, _E4M3_MAX).to(E4M3)

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
