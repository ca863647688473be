"""A node's DRAM index in shared memory: same-host readers find an object without a round trip.

The node (the only writer, under its store lock) publishes each object committed to the DRAM
arena as (key hash, offset, length) in a hash table kept in a second shared-memory file,
`<arena path>.idx`, and unpublishes it *before* its space is freed (eviction, demotion,
removal: a pinned object's entry goes at removal, its space at the last unpin). A reader on the
same host maps the table and the arena read-only and reads optimistically, as a seqlock:

    seq = slot.seq (even: stable) ; offset, length = slot ; copy arena[offset:offset+length] ;
    accept iff slot.seq == seq afterwards.

An unchanged sequence after the copy means the entry was not unpublished during the copy, so
its space was not freed, so nothing else can have been written there: the bytes are the
object's. Anything else (odd or changed sequence, no entry, a full table) sends the reader to
the node's RPC, which is the authority; the index only ever makes a hit cheaper, never turns a
miss into a hit of other data. This relies on the writer's stores and the reader's loads being
seen in program order, which x86-64 (TSO) guarantees; elsewhere `supported()` is False and
readers use the RPC.

Visibility: an object is findable from the moment the node commits it to DRAM, which for a put
is just before the master lists it and the put's reply goes out; the embedded master hides a
removed or evicted object (`StoreNode.hide`) before the call that dropped it returns. In
cluster mode a reader only looks here for objects the master has just said are on this node.

Layout: a 64-byte header (magic, version, slot count, probe length) and `slots + probe` slots
of 40 bytes `<seq, h1, h2, offset, length>` (u64 little-endian), where h1/h2 are the two halves
of the key's xxh3-128. Linear probing, at most `probe` slots from `h1 % slots`, no wrap-around.
seq == 0: never used (a reader stops there); h1 == h2 == 0 with seq > 0: a free slot. A key whose
probe window is full is simply not published (counted in `unpublished`). Keys are matched by
their 128-bit hash: two keys colliding needs ~2^64 objects.
"""

from __future__ import annotations

import logging
import mmap
import os
import platform
import struct

import xxhash

from kvpool.errors import CapacityError, InvalidArgument

log = logging.getLogger(__name__)

MAGIC = b"KVPIDX01"
VERSION = 1
HEADER = struct.Struct("<8sIIII")  # magic, version, slots, probe, slot size
HEADER_SIZE = 64
SLOT = struct.Struct("<QQQQQ")  # seq, h1, h2, offset, length
SEQ = struct.Struct("<Q")
BODY = struct.Struct("<QQQQ")
SLOT_SIZE = SLOT.size
PROBE = 16
MAX_SLOTS = 1 << 22
_M64 = (1 << 64) - 1
_hash = xxhash.xxh3_128_intdigest


def supported() -> bool:
    """Whether optimistic readers are sound on this CPU (ordered loads and stores). Whether to use
    the index at all is the caller's setting (`[rpc] shm_index`)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def auto_slots(dram_capacity: int) -> int:
    """One slot per 32 KiB of arena, as a power of two in [4096, MAX_SLOTS]."""
    want = max(4096, dram_capacity // (32 << 10))
    return min(MAX_SLOTS, 1 << (want - 1).bit_length())


def index_path(arena_path: str) -> str:
    return arena_path + ".idx"


def _key_hash(key: str) -> tuple[int, int]:
    d = _hash(key.encode())
    return d & _M64, d >> 64


class ShmIndex:
    """The writer side (the node). Not thread-safe: the store calls it under its lock."""

    def __init__(self, path: str, slots: int, probe: int = PROBE):
        if slots <= 0 or slots & (slots - 1):
            raise InvalidArgument(f"index slots must be a power of two, got {slots}")
        self.path = path
        self.slots = slots
        self.probe = probe
        self._mask = slots - 1
        self._where: dict[str, int] = {}  # published key -> slot byte offset
        self.unpublished = 0  # objects that found no free slot in their probe window
        size = HEADER_SIZE + (slots + probe) * SLOT_SIZE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise InvalidArgument(f"shared-memory file {path} already exists (another node?)") from None
        try:
            os.ftruncate(fd, size)
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.unlink(path)
            raise CapacityError(f"cannot map a {size}-byte index at {path}: {exc.strerror}") from None
        finally:
            os.close(fd)
        self._buf = memoryview(self._mmap)
        HEADER.pack_into(self._buf, 0, MAGIC, VERSION, slots, probe, SLOT_SIZE)

    def __len__(self) -> int:
        return len(self._where)

    def publish(self, key: str, offset: int, length: int) -> bool:
        """Make `key` findable at (offset, length); False when its probe window is full."""
        if key in self._where:
            self.unpublish(key)
        h1, h2 = _key_hash(key)
        if h1 == 0 and h2 == 0:  # that pair marks a free slot
            self.unpublished += 1
            return False
        buf = self._buf
        pos = HEADER_SIZE + (h1 & self._mask) * SLOT_SIZE
        for _ in range(self.probe):
            seq, a, b, _o, _n = SLOT.unpack_from(buf, pos)
            if seq == 0 or (a == 0 and b == 0):
                SEQ.pack_into(buf, pos, seq + 1)  # odd: a reader that sees this retries elsewhere
                BODY.pack_into(buf, pos + 8, h1, h2, offset, length)
                SEQ.pack_into(buf, pos, seq + 2)
                self._where[key] = pos
                return True
            pos += SLOT_SIZE
        self.unpublished += 1
        return False

    def unpublish(self, key: str) -> None:
        """Forget `key` (call before its space is freed); a no-op for a key not published."""
        pos = self._where.pop(key, None)
        if pos is None:
            return
        buf = self._buf
        seq = SEQ.unpack_from(buf, pos)[0]
        SEQ.pack_into(buf, pos, seq + 1)
        BODY.pack_into(buf, pos + 8, 0, 0, 0, 0)
        SEQ.pack_into(buf, pos, seq + 2)

    def close(self) -> None:
        self._where.clear()
        try:
            self._buf.release()
            self._mmap.close()
        except BufferError:
            log.warning("index %s still has exported views; unmapping deferred", self.path)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class ShmIndexReader:
    """The reader side: a read-only mapping of a node's index. `find` then, after copying,
    `still` (see the module doc); both are cheap enough to run before every RPC."""

    def __init__(self, path: str):
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_SIZE:
                raise InvalidArgument(f"{path} is not a kvpool index")
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self._buf = memoryview(self._mmap)
        magic, version, slots, probe, slot_size = HEADER.unpack_from(self._buf, 0)
        if magic != MAGIC or version != VERSION or slot_size != SLOT_SIZE or slots & (slots - 1) \
                or size < HEADER_SIZE + (slots + probe) * SLOT_SIZE:
            self.close()
            raise InvalidArgument(f"{path} is not a kvpool index of version {VERSION}")
        self._mask = slots - 1
        self._probe = probe

    def find(self, key: str) -> tuple[int, int, int, int] | None:
        """(slot, seq, offset, length) of `key`'s entry as it is now, or None (ask the node)."""
        d = _hash(key.encode())
        h1, h2 = d & _M64, d >> 64
        buf, seq_of, body_of = self._buf, SEQ.unpack_from, BODY.unpack_from
        pos = HEADER_SIZE + (h1 & self._mask) * SLOT_SIZE
        for _ in range(self._probe):
            seq = seq_of(buf, pos)[0]  # read before the body (its own call: never reordered after it)
            if seq == 0:
                return None
            a, b, offset, length = body_of(buf, pos + 8)
            if a == h1 and b == h2:
                return None if seq & 1 else (pos, seq, offset, length)
            pos += SLOT_SIZE
        return None

    def still(self, slot: int, seq: int) -> bool:
        """Whether the entry found as (slot, seq) is unchanged, i.e. what was copied is valid."""
        return SEQ.unpack_from(self._buf, slot)[0] == seq

    def read(self, key: str, arena: memoryview, into: memoryview | None = None) -> bytes | int | None:
        """`key`'s object copied out of `arena` (its node's, mapped here) and validated after the
        copy: its bytes, or with `into` its length (copied into `into` only when it fits); None
        when only the node can answer (no entry, being changed, changed during the copy)."""
        hit = self.find(key)
        if hit is None:
            return None
        slot, seq, offset, n = hit
        if offset + n > len(arena):  # a torn read of an entry being changed
            return None
        if into is None:
            value: bytes | int = bytes(arena[offset:offset + n])
        else:
            if n <= len(into):
                into[:n] = arena[offset:offset + n]
            value = n
        return value if SEQ.unpack_from(self._buf, slot)[0] == seq else None

    def close(self) -> None:
        try:
            self._buf.release()
            self._mmap.close()
        except BufferError:
            pass
