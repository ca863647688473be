"""KV layout and the chunk object format.

A chunk object is a fixed 128-byte header followed by the payload:

    offset size  field
    0      4     magic  b"KVPC"
    4      2     format version (u16, currently 2)
    6      2     header length (u16, 128)
    8      8     layout hash (u64, `KVLayout.layout_hash`)
    16     4     token count (u32; <= chunk_tokens, a tail chunk has fewer)
    20     4     flags (u32: bits 0-7 the payload's codec id, `kvpool.codec`, 0 = none;
                 bit 8 `FLAG_MAC`: the tag is a keyed MAC; rest 0)
    24     8     payload length in bytes (u64)
    32     8     xxh3-64 of the payload (u64, seed 0)
    40     16    namespace digest (`kvpool.keys.Namespace.digest()`)
    56     16    key digest (`key_digest(key)`: BLAKE2b-128 of the pool key's UTF-8)
    72     24    zero
    96     32    tag: with a MAC key, BLAKE3 keyed (32 bytes) over header bytes 0..96 and the
                 payload; without one, zero

All integers little-endian. The payload is layer-major: for each layer, K as
`[kv_heads, tokens, head_dim]` then V likewise, i.e. one C-contiguous array of shape
`[num_layers, 2, kv_heads, tokens, head_dim]`. Each layer is one contiguous slice, so a reader
can use layer 0 while later layers are still arriving.

Binding (`ChunkAuth`): a chunk names where it belongs, the namespace and the key it was written
under, so a valid chunk copied under another key, or another tenant's chunk (tenants' namespaces
differ by their salt), is refused. The unkeyed xxh3 checksum catches accidents; the keyed MAC,
under the tenant's chunk MAC key (`kvpool.security.keyring.chunk_mac_key`), catches writers who lie: without
the tenant's secret nobody can make a chunk its readers accept. BLAKE3 keyed, not HMAC-SHA256:
measured here on 1-8 MiB payloads, 3.2-6 GiB/s against 0.85-1.6 GiB/s (SHA-NI), and a chunk of
the reference model is 6-12 MiB. A reader with a MAC key accepts only chunks with a valid MAC; a
reader without one checks the binding and the checksum (anyone who reaches an unauthenticated
pool may write anything anyway).

Format version 1 (64-byte header, no binding) is not read: it is a `FormatError`, a clean miss.

A layout whose `codec` is not "none" (`kvpool.codec`: int8, fp8, ...) stores the payload that
codec writes (also layer-major) and its id in the flags; the codec is part of the layout hash and
so of the namespace, and `decode_chunk` refuses a chunk of another codec (`LayoutMismatch`). A
writer (`encode_chunk`) and a reader of such a layout pass the codec object; the view then holds
the decoded KV.

Invariant: `decode_chunk` either returns views whose bytes hash to the header's checksum (and,
given a MAC key, carry a valid MAC; given a key and namespace, name them), or raises
(`FormatError`, `LayoutMismatch`, `ChecksumMismatch`, `UntrustedChunk`). Callers turn any of
those into a cache miss, never into data.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from kvpool.errors import ChecksumMismatch, FormatError, InvalidArgument, LayoutMismatch, UntrustedChunk

MAGIC = b"KVPC"
FORMAT_VERSION = 2
HEADER = struct.Struct("<4sHHQIIQQ16s16s24x32s")
HEADER_SIZE = HEADER.size  # 128
assert HEADER_SIZE == 128
TAG_OFFSET = 96  # the MAC covers header bytes [0, TAG_OFFSET) and the payload
TAG_SIZE = 32
FLAG_MAC = 1 << 8
CODEC_MASK = 0xFF
_NO_DIGEST = bytes(16)

# dtype name -> (itemsize, numpy dtype used for views). numpy has no bfloat16: its bytes are
# viewed as uint16 in numpy and reinterpreted as torch.bfloat16 by `ChunkView.as_torch`.
DTYPES: dict[str, tuple[int, Any]] = {
    "float32": (4, np.float32),
    "float16": (2, np.float16),
    "bfloat16": (2, np.uint16),
}


_blake3: Any = None


def _mac(mac_key: bytes, obj: memoryview, payload_end: int) -> bytes:
    """BLAKE3 keyed over header bytes [0, TAG_OFFSET) and the payload (the tag itself excluded)."""
    global _blake3
    if _blake3 is None:
        try:
            from blake3 import blake3 as _b3
        except ImportError:
            raise InvalidArgument("authenticated chunks need the 'blake3' package (pip install blake3)") from None
        _blake3 = _b3
    h = _blake3(key=mac_key)
    h.update(obj[:TAG_OFFSET])
    h.update(obj[HEADER_SIZE:payload_end])
    return h.digest()


def key_digest(key: str) -> bytes:
    """The 16 bytes a chunk header names its pool key by (chunk keys and `tail/<id>` alike)."""
    return hashlib.blake2b(key.encode(), digest_size=16, person=b"kvpool-chunk-key").digest()


@dataclass(frozen=True)
class ChunkAuth:
    """Where a writer's or reader's chunks belong and how they are authenticated: the namespace
    digest (16 bytes, `Namespace.digest()`) and, with a keyring, the tenant's 32-byte chunk MAC
    key (`kvpool.security.keyring.chunk_mac_key`; None: unkeyed, the binding is checked, not authenticated)."""

    namespace: bytes
    mac_key: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.namespace, (bytes, bytearray)) or len(self.namespace) != 16:
            raise InvalidArgument("ChunkAuth.namespace must be a 16-byte namespace digest")
        if self.mac_key is not None and (not isinstance(self.mac_key, (bytes, bytearray)) or len(self.mac_key) != 32):
            raise InvalidArgument("ChunkAuth.mac_key must be 32 bytes (kvpool.security.keyring.chunk_mac_key)")

    @property
    def keyed(self) -> bool:
        return self.mac_key is not None


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


def _torch_dtype(layout: KVLayout) -> Any:
    import torch  # local: torch is optional for the core package

    return getattr(torch, layout.dtype)  # every DTYPES name is torch's name too


def payload_tensor(buf: Any, layout: KVLayout, tokens: int) -> Any:
    """A writable torch view `layout.shape(tokens)` of the payload of the chunk object buffer `buf`
    (`layout.object_nbytes(tokens)` bytes or more), no copy: where in-place writers put the KV
    (layer by layer, straight from a paged cache) before `seal_into` writes the header."""
    import torch

    count = layout.payload_nbytes(tokens) // layout.itemsize
    return torch.frombuffer(buf, dtype=_torch_dtype(layout), count=count, offset=HEADER_SIZE).view(layout.shape(tokens))


def seal_into(buf: Any, layout: KVLayout, tokens: int, *, key: str | None = None, auth: ChunkAuth | None = None,
              payload_nbytes: int | None = None, codec_id: int = 0) -> int:
    """Write the header of a chunk object whose payload is already in `buf[HEADER_SIZE:]`: the one
    place a chunk's header, checksum and MAC are laid out.

    In-place writers fill the payload (`payload_tensor`), so it is never copied a second time;
    `encode_chunk` is this after one copy or encode into a new buffer. Returns the object's size.
    An encoded payload (a layout with a codec) gives its length and its codec's id. `key` (the
    pool key it is stored under) and `auth` (namespace, MAC key) bind the chunk to its place; the
    adapters always give both. Left out, the header names no key / no namespace, and a reader
    that checks them refuses the chunk.
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
    keyed = auth is not None and auth.mac_key is not None
    HEADER.pack_into(dst, 0, MAGIC, FORMAT_VERSION, HEADER_SIZE, layout.layout_hash, tokens,
                     codec_id | (FLAG_MAC if keyed else 0), nbytes, checksum,
                     bytes(auth.namespace) if auth is not None else _NO_DIGEST,
                     key_digest(key) if key is not None else _NO_DIGEST, bytes(TAG_SIZE))
    if keyed:
        dst[TAG_OFFSET:HEADER_SIZE] = _mac(auth.mac_key, dst, total)
    return total


def _encoded(layout: KVLayout, codec: Any, caller: str) -> bool:
    """Whether `codec` encodes the payload; `InvalidArgument` unless it is the layout's own."""
    encoded = codec is not None and codec.name != "none"
    if (layout.codec != "none") != encoded or (codec is not None and codec.name != layout.codec):
        given = getattr(codec, "name", None)
        raise InvalidArgument(f"{caller}: layout codec {layout.codec!r}, codec given {given!r}")
    return encoded


def encode_chunk(layout: KVLayout, kv: Any, tokens: int | None = None, *, key: str | None = None,
                 auth: ChunkAuth | None = None, codec: Any = None) -> bytearray:
    """A new chunk object holding `kv` (`[layers, 2, kv_heads, tokens, head_dim]`, numpy or CPU
    torch), bound to `key` and `auth` when given (see `seal_into`). The payload is copied once,
    straight after the header; for a layout with a codec, `codec` (`kvpool.codec.get_codec(
    layout.codec)`, the one `decode_chunk` takes) encodes the torch tensor `kv` there instead."""
    if tokens is None:
        tokens = int(getattr(kv, "shape")[3])
    if not 0 < tokens <= layout.chunk_tokens:
        raise InvalidArgument(f"tokens must be in 1..{layout.chunk_tokens}, got {tokens}")
    encoded = _encoded(layout, codec, "encode_chunk")
    shape = tuple(getattr(kv, "shape", ()))
    if shape != layout.shape(tokens):
        raise InvalidArgument(f"kv has shape {shape}, layout expects {layout.shape(tokens)}")
    if encoded:
        out = bytearray(HEADER_SIZE + codec.max_encoded_nbytes(layout, tokens))
        n = codec.encode_into(layout, kv, memoryview(out)[HEADER_SIZE:])
        if HEADER_SIZE + n < len(out):  # a variable-rate codec: keep what it wrote
            del out[HEADER_SIZE + n:]
        seal_into(out, layout, tokens, key=key, auth=auth, payload_nbytes=n, codec_id=codec.codec_id)
        return out
    src = _as_bytes_view(kv)
    nbytes = layout.payload_nbytes(tokens)
    if src.nbytes != nbytes:
        raise InvalidArgument(f"kv has {src.nbytes} bytes, layout {layout.dtype} expects {nbytes}")
    out = bytearray(HEADER_SIZE + nbytes)
    memoryview(out)[HEADER_SIZE:] = src  # one memcpy (a bytearray slice assignment copies src first)
    seal_into(out, layout, tokens, key=key, auth=auth)
    return out


@dataclass(frozen=True)
class ChunkHeader:
    version: int
    layout_hash: int
    tokens: int
    flags: int
    payload_nbytes: int
    checksum: int
    namespace: bytes = _NO_DIGEST
    key_digest: bytes = _NO_DIGEST
    tag: bytes = bytes(TAG_SIZE)

    @property
    def codec_id(self) -> int:
        return self.flags & CODEC_MASK

    @property
    def keyed(self) -> bool:
        return bool(self.flags & FLAG_MAC)


def read_header(buf: Any) -> ChunkHeader:
    """Parse and sanity-check the header; raises `FormatError` on anything malformed."""
    view = memoryview(buf).cast("B")
    if view.nbytes < HEADER_SIZE:
        raise FormatError(f"chunk object of {view.nbytes} bytes is shorter than its {HEADER_SIZE}-byte header")
    magic, version = struct.unpack_from("<4sH", view, 0)
    if magic != MAGIC:
        raise FormatError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise FormatError(f"unsupported chunk format version {version} (this build reads {FORMAT_VERSION}; "
                          "version 1 chunks name no key or namespace and are a miss)")
    _, _, header_len, layout_hash, tokens, flags, nbytes, checksum, ns, kd, tag = HEADER.unpack_from(view, 0)
    if header_len != HEADER_SIZE:
        raise FormatError(f"bad header length {header_len}")
    if flags & ~(CODEC_MASK | FLAG_MAC):
        raise FormatError(f"unknown chunk header flags {flags:#x}")
    if view.nbytes < HEADER_SIZE + nbytes:
        raise FormatError(f"truncated chunk object: header says {nbytes} payload bytes, have {view.nbytes - HEADER_SIZE}")
    return ChunkHeader(version, layout_hash, tokens, flags, nbytes, checksum, ns, kd, tag)


def check_binding(view: Any, header: ChunkHeader, *, key: str | None, auth: ChunkAuth | None) -> None:
    """Raise `UntrustedChunk` unless the chunk names `auth`'s namespace and `key`, and (given a MAC
    key) carries a valid MAC. Cheap checks first: the MAC reads the whole payload."""
    if auth is not None and not hmac.compare_digest(header.namespace, bytes(auth.namespace)):
        raise UntrustedChunk(f"chunk belongs to namespace {header.namespace.hex()}, reader {bytes(auth.namespace).hex()} "
                             "(another tenant, model or layout)")
    if key is not None and not hmac.compare_digest(header.key_digest, key_digest(key)):
        raise UntrustedChunk(f"chunk under {key} was written under another key (a copy of another chunk)")
    if auth is not None and auth.mac_key is not None:
        if not header.keyed:
            raise UntrustedChunk("chunk carries no MAC; this reader accepts only chunks MACed under its tenant's key")
        obj = memoryview(view).cast("B")
        end = HEADER_SIZE + header.payload_nbytes
        if not hmac.compare_digest(_mac(auth.mac_key, obj, end), header.tag):
            intact = xxhash.xxh3_64_intdigest(obj[HEADER_SIZE:end]) == header.checksum
            raise UntrustedChunk("chunk MAC does not verify (" + ("checksum intact: written without this tenant's key"
                                 if intact else "checksum fails too: damaged, or written without the key") + ")")


class ChunkView:
    """Zero-copy views into a decoded chunk object (valid while the buffer is alive); for a layout
    with a codec, the KV decoded from it (`decoded`, a tensor of its own)."""

    def __init__(self, layout: KVLayout, header: ChunkHeader, payload: memoryview, decoded: Any = None):
        self.layout = layout
        self.header = header
        self.payload = payload
        self.decoded = decoded
        self.tier = ""  # the pool tier a reader got it from ("dram" | "ssd"), when it knows

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

        with warnings.catch_warnings():  # read-only buffers warn; callers copy before writing
            warnings.simplefilter("ignore")
            tensor = torch.frombuffer(self.payload, dtype=_torch_dtype(self.layout))
        return tensor.reshape(self.layout.shape(self.tokens))


def decode_chunk(buf: Any, layout: KVLayout, *, key: str | None = None, auth: ChunkAuth | None = None,
                 verify: bool = True, codec: Any = None) -> ChunkView:
    """Check header, binding, layout and checksum of a chunk object and return views of its payload.

    `key` (the pool key it was read from) and `auth` (the reader's namespace and MAC key) are
    checked when given (`UntrustedChunk`); every adapter gives both (`ChunkReader`). `verify=False`
    skips the unkeyed checksum only, never a MAC.

    A layout with a codec needs that codec (`kvpool.codec.get_codec(layout.codec)`): the header
    must carry its id, the payload its size, and the view holds the decoded KV (a payload that
    does not decode raises the codec's `FormatError`)."""
    encoded = _encoded(layout, codec, "decode_chunk")
    view = memoryview(buf).cast("B")
    header = read_header(view)
    check_binding(view, header, key=key, auth=auth)
    if header.layout_hash != layout.layout_hash:
        raise LayoutMismatch(
            f"chunk written for layout hash {header.layout_hash:016x}, reader expects {layout.layout_hash:016x}"
        )
    codec_id = codec.codec_id if encoded else 0
    if header.codec_id != codec_id:
        raise LayoutMismatch(f"chunk payload has codec id {header.codec_id} (flags {header.flags:#x}), "
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

        decoded = torch.empty(layout.shape(header.tokens), dtype=_torch_dtype(layout))
        codec.decode_into(layout, payload, decoded)
    return ChunkView(layout, header, payload, decoded)
