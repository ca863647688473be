"""KV layout and the chunk object format.

A chunk object is a fixed 64-byte header followed by the payload:

    offset size  field
    0      4     magic  b"KVPC"
    4      2     format version (u16, currently 1)
    6      2     header length (u16, 64)
    8      8     layout hash (u64, `KVLayout.layout_hash`)
    16     4     token count (u32; <= chunk_tokens, a tail chunk has fewer)
    20     4     flags (u32, 0; reserved)
    24     8     payload length in bytes (u64)
    32     8     xxh3-64 of the payload (u64, seed 0)
    40     24    zero

All integers little-endian. The payload is layer-major: for each layer, K as
`[kv_heads, tokens, head_dim]` then V likewise, i.e. one C-contiguous array of shape
`[num_layers, 2, kv_heads, tokens, head_dim]`. Each layer is one contiguous slice, so a reader
can use layer 0 while later layers are still arriving.

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

    def __post_init__(self) -> None:
        for name in ("num_layers", "kv_heads", "head_dim", "chunk_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidArgument(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPES:
            raise InvalidArgument(f"KVLayout.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

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


def seal_into(buf: Any, layout: KVLayout, tokens: int) -> int:
    """Write the header of a chunk object whose payload is already in `buf[HEADER_SIZE:]`.

    For writers that fill the payload in place (layer by layer, or straight from a paged cache),
    so the payload is never copied a second time. Returns the object's size.
    """
    dst = memoryview(buf).cast("B")
    nbytes = layout.payload_nbytes(tokens)
    total = HEADER_SIZE + nbytes
    if dst.nbytes < total:
        raise InvalidArgument(f"buffer holds {dst.nbytes} bytes, a {tokens}-token chunk object needs {total}")
    checksum = xxhash.xxh3_64_intdigest(dst[HEADER_SIZE:total])
    HEADER.pack_into(dst, 0, MAGIC, FORMAT_VERSION, HEADER_SIZE, layout.layout_hash, tokens, 0, nbytes, checksum)
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
    """Zero-copy views into a decoded chunk object (valid while the buffer is alive)."""

    def __init__(self, layout: KVLayout, header: ChunkHeader, payload: memoryview):
        self.layout = layout
        self.header = header
        self.payload = payload

    @property
    def tokens(self) -> int:
        return self.header.tokens

    def as_numpy(self) -> np.ndarray:
        """`[layers, 2, kv_heads, tokens, head_dim]`; bfloat16 appears as uint16."""
        np_dtype = DTYPES[self.layout.dtype][1]
        return np.frombuffer(self.payload, dtype=np_dtype).reshape(self.layout.shape(self.tokens))

    def layer(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """K and V of layer `i`, each `[kv_heads, tokens, head_dim]`."""
        arr = self.as_numpy()[i]
        return arr[0], arr[1]

    def as_torch(self):
        """The same bytes as a torch tensor (bfloat16 included); no copy."""
        import warnings

        import torch

        dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[self.layout.dtype]
        with warnings.catch_warnings():  # read-only buffers warn; callers copy before writing
            warnings.simplefilter("ignore")
            tensor = torch.frombuffer(self.payload, dtype=dtype)
        return tensor.reshape(self.layout.shape(self.tokens))


def decode_chunk(buf: Any, layout: KVLayout, *, verify: bool = True) -> ChunkView:
    """Check header, layout and checksum of a chunk object and return views of its payload."""
    view = memoryview(buf).cast("B")
    header = read_header(view)
    if header.layout_hash != layout.layout_hash:
        raise LayoutMismatch(
            f"chunk written for layout hash {header.layout_hash:016x}, reader expects {layout.layout_hash:016x}"
        )
    if not 0 < header.tokens <= layout.chunk_tokens or header.payload_nbytes != layout.payload_nbytes(header.tokens):
        raise FormatError(f"token count {header.tokens} and payload {header.payload_nbytes} B disagree with the layout")
    payload = view[HEADER_SIZE : HEADER_SIZE + header.payload_nbytes]
    if verify and xxhash.xxh3_64_intdigest(payload) != header.checksum:
        raise ChecksumMismatch("chunk payload checksum mismatch: the object is damaged")
    return ChunkView(layout, header, payload)
