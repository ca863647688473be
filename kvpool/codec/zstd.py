"""`<codec>+zstd`: a lossless zstd stage after a fixed-rate codec (none, int8, fp8).

Each layer of the inner payload is compressed as its own zstd frame (the payload stays
layer-major); each frame carries zstd's content checksum, so a damaged frame is an error, never
other codes. For `none` the layer's bytes are first split into byte planes (all first bytes of the
elements, then all second bytes, ...): the exponent bytes of floats repeat far more than the
mantissa bytes, and zstd sees that only when they are adjacent.

Payload:

    u32 num_layers, num_layers x u32 frame length, the frames (all little-endian)

Round trip: exactly the inner codec's (exact for none+zstd). Size: whatever zstd achieves, at most
`max_encoded_nbytes`; `kvpool bench codec` measures it on the reference model's KV.
"""

from __future__ import annotations

import itertools
import struct
import threading
from typing import Any

import numpy as np
import torch
import zstandard

from kvpool.codec._tensors import check_kv
from kvpool.errors import FormatError
from kvpool.chunk_format import KVLayout

LEVEL = 1  # zstd's fastest regular level: the stage already runs at ~0.5 GB/s here; higher levels not measured
_U32 = struct.Struct("<I")


def compress_bound(n: int) -> int:
    """zstd's ZSTD_COMPRESSBOUND: the largest frame `n` input bytes can compress to."""
    return n + (n >> 8) + (((128 << 10) - n) >> 11 if n < (128 << 10) else 0)


class ZstdStage:
    lossless: bool
    fixed_rate = False

    def __init__(self, inner: Any, codec_id: int, level: int = LEVEL):
        self.inner = inner
        self.name = f"{inner.name}+zstd"
        self.codec_id = codec_id
        self.lossless = inner.lossless
        self.level = level
        self._local = threading.local()  # zstandard contexts are not thread-safe

    def _contexts(self) -> tuple[Any, Any]:
        ctx = getattr(self._local, "ctx", None)
        if ctx is None:
            ctx = self._local.ctx = (zstandard.ZstdCompressor(level=self.level, write_checksum=True),
                                    zstandard.ZstdDecompressor())
        return ctx

    @staticmethod
    def _one_layer(layout: KVLayout) -> KVLayout:
        return KVLayout(1, layout.kv_heads, layout.head_dim, layout.dtype, layout.chunk_tokens)

    def _plane_width(self, layout: KVLayout) -> int:
        return layout.itemsize if self.inner.name == "none" else 1

    def max_encoded_nbytes(self, layout: KVLayout, tokens: int) -> int:
        per = self.inner.max_encoded_nbytes(self._one_layer(layout), tokens)
        return 4 * (1 + layout.num_layers) + layout.num_layers * compress_bound(per)

    def encode_into(self, layout: KVLayout, kv: Any, out: Any) -> int:
        tokens = check_kv(layout, kv)
        raw = np.empty(self.inner.max_encoded_nbytes(layout, tokens), dtype=np.uint8)
        self.inner.encode_into(layout, kv, raw)
        width = self._plane_width(layout)
        compressor = self._contexts()[0]
        frames = []
        for layer in raw.reshape(layout.num_layers, -1):
            if width > 1:
                layer = np.ascontiguousarray(layer.reshape(-1, width).T)
            frames.append(compressor.compress(layer))
        total = 4 * (1 + len(frames)) + sum(len(f) for f in frames)
        dst = memoryview(out).cast("B")
        if dst.nbytes < total:
            raise FormatError(f"output buffer holds {dst.nbytes} bytes, the {self.name} payload needs {total}")
        _U32.pack_into(dst, 0, len(frames))
        pos = 4 * (1 + len(frames))
        for i, frame in enumerate(frames):
            _U32.pack_into(dst, 4 * (1 + i), len(frame))
            dst[pos:pos + len(frame)] = frame
            pos += len(frame)
        return total

    def _frames(self, layout: KVLayout, payload: Any) -> list[memoryview]:
        view = memoryview(payload).cast("B")
        table = 4 * (1 + layout.num_layers)
        if view.nbytes < table or _U32.unpack_from(view, 0)[0] != layout.num_layers:
            raise FormatError(f"{self.name} payload of {view.nbytes} bytes has no table of {layout.num_layers} layers")
        lengths = [_U32.unpack_from(view, 4 * (1 + i))[0] for i in range(layout.num_layers)]
        if table + sum(lengths) != view.nbytes:
            raise FormatError(f"{self.name} payload of {view.nbytes} bytes; its table says {table + sum(lengths)}")
        ends = list(itertools.accumulate(lengths, initial=table))
        return [view[start:end] for start, end in zip(ends, ends[1:])]

    def _inner_layer(self, layout: KVLayout, frame: memoryview, tokens: int) -> np.ndarray:
        """The inner codec's payload of one layer, decompressed (and its byte planes rejoined)."""
        expected = self.inner.max_encoded_nbytes(self._one_layer(layout), tokens)
        try:  # the frame's declared size first: a damaged one may claim gigabytes
            declared = zstandard.frame_content_size(frame)
            if declared != expected:
                raise FormatError(f"damaged {self.name} payload: a layer frame declares {declared} bytes, not {expected}")
            raw = self._contexts()[1].decompress(frame, max_output_size=expected)
        except (zstandard.ZstdError, MemoryError) as exc:
            raise FormatError(f"damaged {self.name} payload: {exc}") from exc
        if len(raw) != expected:
            raise FormatError(f"damaged {self.name} payload: a layer decompresses to {len(raw)} bytes, not {expected}")
        arr = np.frombuffer(raw, dtype=np.uint8)
        width = self._plane_width(layout)
        return np.ascontiguousarray(arr.reshape(width, -1).T).reshape(-1) if width > 1 else arr

    def decode_into(self, layout: KVLayout, payload: Any, out: Any) -> None:
        tokens = check_kv(layout, out, "out")
        one = self._one_layer(layout)
        for i, frame in enumerate(self._frames(layout, payload)):
            self.inner.decode_into(one, self._inner_layer(layout, frame, tokens), out[i:i + 1])

    def error_bound(self, layout: KVLayout, kv: Any) -> torch.Tensor:
        return self.inner.error_bound(layout, kv)

