"""Chunk payload codecs: how the KV of one chunk is written as bytes (and read back).

A codec turns the KV of one chunk, a tensor `[layers, 2, kv_heads, tokens, head_dim]` in the
layout's dtype (`kvpool.chunk_format.KVLayout`), into a payload and back. Registered codecs:

    name        id  bytes vs bf16 (256-token chunk)  round trip
    none        0   1.0 (the layout dtype's bytes)    exact
    int8        1   0.510 (codes + bf16 scales)       |x^ - x| <= s/2, s = amax/127 (K per channel, V per token)
    fp8         2   0.510 (codes + bf16 scales)       |x^ - x| <= |x|/16 + s/1024, s = amax/448 (e4m3)
    none+zstd   3   variable (lossless)               exact
    int8+zstd   4   variable                          as int8
    fp8+zstd    5   variable                          as fp8

Measured on the reference model's KV (`kvpool bench codec`, 28 prompts x 64 greedy tokens,
float32 model): int8 agrees with the uncompressed run on 0.994 of the tokens re-synchronised
(0.877 up to the first divergence), fp8 on 0.984 (0.627); zstd brings int8 to 0.484x and fp8 to
0.419x of bf16, and float32 KV losslessly to 0.867x, at ~0.3-0.6 GB/s.

(plus the rounding of x^ into the layout dtype; `Codec.error_bound` gives the exact per-element
bound that the conformance suite, tests/kvpool/codec, checks.) The id is what a chunk header
records; ids never change meaning.

Invariants every codec keeps:
- `decode_into(encode(kv))` is bit-exact for a lossless codec, and within `error_bound(kv)`
  element by element for a lossy one, for float32, bfloat16 and float16 layouts and any token
  count 1..chunk_tokens.
- A payload of the wrong length, or one whose structure does not decode (a non-finite or negative
  scale, a damaged zstd frame), raises `FormatError` (a `CorruptObject`: the reader's miss), never
  returns KV. Flipped bits inside 8-bit codes are valid codes: the chunk checksum
  (`kvpool.chunk_format`) is what catches those.
- The payload is layer-major: layer i is its own slice (a zstd frame of its own under `+zstd`).
- Encoding never modifies its input; non-finite KV is refused (`InvalidArgument`) by lossy codecs.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol, runtime_checkable

from kvpool.errors import InvalidArgument, Unavailable
from kvpool.chunk_format import KVLayout

# name -> (id recorded in the chunk header, "module:factory"); ids never change meaning. A `+zstd`
# factory is given the inner codec and the id.
CODECS: dict[str, tuple[int, str]] = {
    "none": (0, "kvpool.codec.none:NoneCodec"),
    "int8": (1, "kvpool.codec.scaled:Int8Codec"),
    "fp8": (2, "kvpool.codec.scaled:Fp8Codec"),
    "none+zstd": (3, "kvpool.codec.zstd:ZstdStage"),
    "int8+zstd": (4, "kvpool.codec.zstd:ZstdStage"),
    "fp8+zstd": (5, "kvpool.codec.zstd:ZstdStage"),
}


@runtime_checkable
class Codec(Protocol):
    """One way to write the KV of a chunk as bytes. Stateless and thread-safe."""

    name: str
    codec_id: int
    lossless: bool
    fixed_rate: bool  # the payload size depends only on (layout, tokens)

    def max_encoded_nbytes(self, layout: KVLayout, tokens: int) -> int:
        """Bytes `encode_into` may write for `tokens` tokens (exact when `fixed_rate`)."""
        ...

    def encode_into(self, layout: KVLayout, kv: Any, out: Any) -> int:
        """Write the payload of `kv` (CPU tensor `layout.shape(tokens)`, layout dtype) into the
        writable buffer `out`; return the bytes written."""
        ...

    def decode_into(self, layout: KVLayout, payload: Any, out: Any) -> None:
        """Decode `payload` (exactly the encoded bytes) into `out` (`layout.shape(tokens)`)."""
        ...

    def error_bound(self, layout: KVLayout, kv: Any) -> Any:
        """Per-element bound on `|decode(encode(kv)) - kv|` (a float64 tensor shaped like `kv`)."""
        ...


_loaded: dict[str, Codec] = {}


def get_codec(name: str) -> Codec:
    """The codec registered as `name`; `InvalidArgument` for an unknown name, `Unavailable` when
    its library (e.g. zstandard) is not installed."""
    codec = _loaded.get(name)
    if codec is not None:
        return codec
    entry = CODECS.get(name)
    if entry is None:
        raise InvalidArgument(f"unknown KV codec {name!r}; known: {', '.join(CODECS)}")
    module, attr = entry[1].split(":")
    try:
        factory = getattr(importlib.import_module(module), attr)
        codec = factory(get_codec(name[:-len("+zstd")]), entry[0]) if name.endswith("+zstd") else factory()
    except ImportError as exc:
        raise Unavailable(f"KV codec {name!r} needs {exc.name!r}, which is not installed") from exc
    if codec.name != name or codec.codec_id != entry[0]:
        raise AssertionError(f"codec registry and {module} disagree about {name!r}")
    _loaded[name] = codec
    return codec


def stored_bytes_per_token(layout: KVLayout) -> int:
    """Pool bytes of one token of `layout` as its codec stores a full chunk (payload only): what a
    fetch moves and a tier holds. Exact for a fixed-rate codec, the bound for a variable-rate one
    (`+zstd`: the real size depends on the data); `layout.bytes_per_token` for `none`."""
    if layout.codec == "none":
        return layout.bytes_per_token
    nbytes = get_codec(layout.codec).max_encoded_nbytes(layout, layout.chunk_tokens)
    return -(-nbytes // layout.chunk_tokens)


def codec_name(codec_id: int) -> str:
    """The name of a codec id (as read from a chunk header); `InvalidArgument` when unknown."""
    for name, (cid, _) in CODECS.items():
        if cid == codec_id:
            return name
    raise InvalidArgument(f"unknown KV codec id {codec_id}")


def encode(codec: Codec, layout: KVLayout, kv: Any) -> bytearray:
    """The payload of `kv` as a new buffer (trimmed to its size)."""
    shape = tuple(getattr(kv, "shape", ()))
    if len(shape) != 5:
        raise InvalidArgument(f"kv has shape {shape}, expected [layers, 2, kv_heads, tokens, head_dim]")
    tokens = int(shape[3])
    out = bytearray(codec.max_encoded_nbytes(layout, tokens))
    n = codec.encode_into(layout, kv, out)
    del out[n:]
    return out


def decode(codec: Codec, layout: KVLayout, payload: Any, tokens: int) -> Any:
    """A new tensor `layout.shape(tokens)` holding the decoded payload."""
    from kvpool.codec._tensors import empty_kv

    out = empty_kv(layout, tokens)
    codec.decode_into(layout, payload, out)
    return out


__all__ = ["CODECS", "Codec", "codec_name", "decode", "encode", "get_codec", "stored_bytes_per_token"]
