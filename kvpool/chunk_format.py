"""KV layout and the chunk object format.

A chunk object is a fixed 64-byte header followed by the payload:

    offset size  field
    0      4     magic  b"KVPC"
    4      2     format version (u16, currently 1)
    6      2     header length (u16, 64)
    8      8     layout hash (u64, `KVLayout.layout_hash`)
    16     4     token count (u32; <= chunk_tokens, a tail chunk has fewer)
    20     4     flags (u32: bits 0-7 the payload's codec id, `kvpool.codec`; 0 = none; rest 0)
    24     8     payload length in bytes (u64)
    32     8     xxh3-64 of the payload (u64, seed 0)
    40     24    zero

All integers little-endian. The payload is layer-major: for each layer, K as
`[kv_heads, tokens, head_dim]` then V likewise, i.e. one C-contiguous array of shape
`[num_layers, 2, kv_heads, tokens, head_dim]`. Each layer is one contiguous slice, so a reader
can use layer 0 while later layers are still arriving.

A layout whose `codec` is not "none" (`kvpool.codec`: int8, fp8, ...) stores the payload that
codec writes (also layer-major) and its id in the flags; the codec is part of the layout hash and
so of the namespace, and `decode_chunk` refuses a chunk of another codec (`LayoutMismatch`). A
reader of such a layout passes the codec object; the view then holds the decoded KV.

Invariant: `decode_chunk` either returns views whose bytes hash to the header's checksum, or
raises (`FormatError`, `LayoutMismatch`, `ChecksumMismatch`). Callers turn any of those into a
cache miss, never into data.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from kvpool.errors import ChecksumMismatch, FormatError, InvalidArgument, LayoutMismatch

MAGIC = b"KVPC"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sHHQIIQQ24x")
HEADER_SIZE = HEADER.size  # 64
assert HEADER_SIZE == 64

# dtype name -> (itemsize, numpy dtype used for views). numpy has no bfloat16: its bytes are
# viewed as uint16 in numpy and reinterpreted as torch.bfloat16 by `ChunkView.as_torch`.
DTYPES: dict[str, tuple[int, Any]] = {
    "float32": (4, np.float32),
    "float16": (2, np.float16),
    "bfloat16": (2, np.uint16),
}


@dataclass(frozen=True)
class KVLayout:
    """Shape of the KV cache of one model (one tensor-parallel rank)."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "float32"
    chunk_tokens: int = 256
    codec: str = "none"  # how chunk payloads are encoded (a `kvpool.codec` name); "none": the KV's own bytes

    def __post_init__(self) -> None:
        for name in ("num_layers", "kv_heads", "head_dim", "chunk_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidArgument(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPES:
            raise InvalidArgument(f"KVLayout.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.codec, str) or not self.codec:
            raise InvalidArgument(f"KVLayout.codec must be a codec name, got {self.codec!r}")

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][0]

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token across all layers."""
        return self.num_layers * 2 * self.kv_heads * self.head_dim * self.itemsize

    def payload_nbytes(self, tokens: int) -> int:
        return tokens * self.bytes_per_token

    def object_nbytes(self, tokens: int | None = None) -> int:
        """Size of an encoded chunk object holding `tokens` tokens (default: a full chunk)."""
        return HEADER_SIZE + self.payload_nbytes(self.chunk_tokens if tokens is None else tokens)

    @property
    def bytes_per_chunk(self) -> int:
        return self.object_nbytes()

    def canonical(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "chunk_tokens": self.chunk_tokens,
            # only when set, so the hash (and namespace) of an uncompressed layout never changed
            **({"codec": self.codec} if self.codec != "none" else {}),
        }

    @property
    def layout_hash(self) -> int:
        """xxh3-64 of the canonical JSON (sorted keys, no spaces) of the fields above."""
        text = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))
        return xxhash.xxh3_64_intdigest(text.encode())

    def shape(self, tokens: int) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.kv_heads, tokens, self.head_dim)


def _as_bytes_view(kv: Any) -> memoryview:
    """A flat byte view of a C-contiguous numpy array or CPU torch tensor, without copying."""
    if hasattr(kv, "detach") and hasattr(kv, "untyped_storage"):  # torch.Tensor
        if kv.device.type != "cpu":
            raise InvalidArgument("encode_chunk takes CPU tensors; copy device tensors to host first")
        if not kv.is_contiguous():
            kv = kv.contiguous()
        import torch  # local: torch is optional for the core package

        kv = kv.detach()
        if kv.dtype == torch.bfloat16:
            kv = kv.view(torch.int16)
        return memoryview(kv.numpy()).cast("B")
    arr = np.ascontiguousarray(kv)
    return memoryview(arr).cast("B")


def encode_into(out: Any, layout: KVLayout, kv: Any, tokens: int) -> int:
    """Write a chunk object holding `kv` (shape `layout.shape(tokens)`) into `out`.

    `out` is any writable buffer of at least `layout.object_nbytes(tokens)` bytes. Returns the
    number of bytes written. The payload is copied once, straight into `out`.
    """
    if not 0 < tokens <= layout.chunk_tokens:
        raise InvalidArgument(f"tokens must be in 1..{layout.chunk_tokens}, got {tokens}")
    if layout.codec != "none":
        raise InvalidArgument(f"a {layout.codec} layout's chunks are written by kvpool.codec.encode_object")
    shape = tuple(getattr(kv, "shape", ()))
    if shape != layout.shape(tokens):
        raise InvalidArgument(f"kv has shape {shape}, layout expects {layout.shape(tokens)}")
    src = _as_bytes_view(kv)
    nbytes = layout.payload_nbytes(tokens)
    if src.nbytes != nbytes:
        raise InvalidArgument(f"kv has {src.nbytes} bytes, layout {layout.dtype} expects {nbytes}")
    dst = memoryview(out).cast("B")
    total = HEADER_SIZE + nbytes
    if dst.nbytes < total:
        raise InvalidArgument(f"output buffer holds {dst.nbytes} bytes, need {total}")
    dst[HEADER_SIZE:total] = src
    return seal_into(dst, layout, tokens)


def seal_into(buf: Any, layout: KVLayout, tokens: int, *, payload_nbytes: int | None = None,
              codec_id: int = 0) -> int:
    """Write the header of a chunk object whose payload is already in `buf[HEADER_SIZE:]`.

    For writers that fill the payload in place (layer by layer, or straight from a paged cache),
    so the payload is never copied a second time. Returns the object's size. An encoded payload
    (a layout with a codec) gives its length and its codec's id (`kvpool.codec.encode_object`).
    """
    dst = memoryview(buf).cast("B")
    if (layout.codec != "none") != (payload_nbytes is not None) or not 0 <= codec_id <= 0xFF:
        raise InvalidArgument(f"seal_into: a {layout.codec!r} layout needs "
                              f"{'no' if layout.codec == 'none' else 'its'} encoded payload length and codec id")
    nbytes = layout.payload_nbytes(tokens) if payload_nbytes is None else payload_nbytes
    total = HEADER_SIZE + nbytes
    if dst.nbytes < total:
        raise InvalidArgument(f"buffer holds {dst.nbytes} bytes, a {tokens}-token chunk object needs {total}")
    checksum = xxhash.xxh3_64_intdigest(dst[HEADER_SIZE:total])
    HEADER.pack_into(dst, 0, MAGIC, FORMAT_VERSION, HEADER_SIZE, layout.layout_hash, tokens, codec_id, nbytes, checksum)
    return total


def encode_chunk(layout: KVLayout, kv: Any, tokens: int | None = None) -> bytearray:
    """Encode `kv` (`[layers, 2, kv_heads, tokens, head_dim]`) as a new chunk object."""
    if tokens is None:
        tokens = int(getattr(kv, "shape")[3])
    out = bytearray(layout.object_nbytes(tokens))
    encode_into(out, layout, kv, tokens)
    return out


@dataclass(frozen=True)
class ChunkHeader:
    version: int
    layout_hash: int
    tokens: int
    flags: int
    payload_nbytes: int
    checksum: int


def read_header(buf: Any) -> ChunkHeader:
    """Parse and sanity-check the header; raises `FormatError` on anything malformed."""
    view = memoryview(buf).cast("B")
    if view.nbytes < HEADER_SIZE:
        raise FormatError(f"chunk object of {view.nbytes} bytes is shorter than its {HEADER_SIZE}-byte header")
    magic, version, header_len, layout_hash, tokens, flags, nbytes, checksum = HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise FormatError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise FormatError(f"unsupported chunk format version {version} (this build reads {FORMAT_VERSION})")
    if header_len != HEADER_SIZE:
        raise FormatError(f"bad header length {header_len}")
    if view.nbytes < HEADER_SIZE + nbytes:
        raise FormatError(f"truncated chunk object: header says {nbytes} payload bytes, have {view.nbytes - HEADER_SIZE}")
    return ChunkHeader(version, layout_hash, tokens, flags, nbytes, checksum)


class ChunkView:
    """Zero-copy views into a decoded chunk object (valid while the buffer is alive); for a layout
    with a codec, the KV decoded from it (`decoded`, a tensor of its own)."""

    def __init__(self, layout: KVLayout, header: ChunkHeader, payload: memoryview, decoded: Any = None):
        self.layout = layout
        self.header = header
        self.payload = payload
        self.decoded = decoded

    @property
    def tokens(self) -> int:
        return self.header.tokens

    def as_numpy(self) -> np.ndarray:
        """`[layers, 2, kv_heads, tokens, head_dim]`; bfloat16 appears as uint16."""
        if self.decoded is not None:
            import torch

            kv = self.decoded.view(torch.int16) if self.decoded.dtype == torch.bfloat16 else self.decoded
            return kv.numpy().view(DTYPES[self.layout.dtype][1])
        np_dtype = DTYPES[self.layout.dtype][1]
        return np.frombuffer(self.payload, dtype=np_dtype).reshape(self.layout.shape(self.tokens))

    def layer(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """K and V of layer `i`, each `[kv_heads, tokens, head_dim]`."""
        arr = self.as_numpy()[i]
        return arr[0], arr[1]

    def as_torch(self):
        """The same bytes as a torch tensor (bfloat16 included); no copy."""
        if self.decoded is not None:
            return self.decoded
        import warnings

        import torch

        dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[self.layout.dtype]
        with warnings.catch_warnings():  # read-only buffers warn; callers copy before writing
            warnings.simplefilter("ignore")
            tensor = torch.frombuffer(self.payload, dtype=dtype)
        return tensor.reshape(self.layout.shape(self.tokens))


def decode_chunk(buf: Any, layout: KVLayout, *, verify: bool = True, codec: Any = None) -> ChunkView:
    """Check header, layout and checksum of a chunk object and return views of its payload.

    A layout with a codec needs that codec (`kvpool.codec.get_codec(layout.codec)`): the header
    must carry its id, the payload its size, and the view holds the decoded KV (a payload that
    does not decode raises the codec's `FormatError`)."""
    if (layout.codec != "none") != (codec is not None and codec.name != "none") or \
            (codec is not None and codec.name != layout.codec):
        raise InvalidArgument(f"decode_chunk: layout codec {layout.codec!r}, codec given "
                              f"{getattr(codec, 'name', None)!r}")
    view = memoryview(buf).cast("B")
    header = read_header(view)
    if header.layout_hash != layout.layout_hash:
        raise LayoutMismatch(
            f"chunk written for layout hash {header.layout_hash:016x}, reader expects {layout.layout_hash:016x}"
        )
    encoded = codec is not None and codec.name != "none"
    codec_id = codec.codec_id if encoded else 0
    if header.flags != codec_id:
        raise LayoutMismatch(f"chunk payload has codec id {header.flags & 0xFF} (flags {header.flags:#x}), "
                             f"reader expects {codec_id} ({layout.codec})")
    if not 0 < header.tokens <= layout.chunk_tokens:
        raise FormatError(f"token count {header.tokens} disagrees with the layout's chunk of {layout.chunk_tokens}")
    if encoded:
        limit = codec.max_encoded_nbytes(layout, header.tokens)
        fits = header.payload_nbytes == limit if codec.fixed_rate else header.payload_nbytes <= limit
    else:
        fits = header.payload_nbytes == layout.payload_nbytes(header.tokens)
    if not fits:
        raise FormatError(f"payload of {header.payload_nbytes} B disagrees with {header.tokens} tokens of the layout")
    payload = view[HEADER_SIZE : HEADER_SIZE + header.payload_nbytes]
    if verify and xxhash.xxh3_64_intdigest(payload) != header.checksum:
        raise ChecksumMismatch("chunk payload checksum mismatch: the object is damaged")
    decoded = None
    if encoded:
        import torch

        dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[layout.dtype]
        decoded = torch.empty(layout.shape(header.tokens), dtype=dtype)
        codec.decode_into(layout, payload, decoded)
    return ChunkView(layout, header, payload, decoded)
