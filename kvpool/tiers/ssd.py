"""SSD tier: one lmdb environment per node, sized from the tier's capacity.

Each object is two records written in one lmdb transaction, keyed by the xxh3-128 digest of its
key (lmdb keys are limited to 511 bytes; ours may be 512):

    meta: magic b"KVSS" | version u16 | key length u16 | payload length u64 | xxh3-64 u64 | key
    data: the payload, passed to lmdb straight from the caller's buffer (no concatenation).

Durability: lmdb does not fsync on commit: the tier is a cache, and a kill -9 of the process
cannot lose committed pages (they are in the OS page cache). An OS crash may lose recent objects.

Files: the directory is 0700 and lmdb's files 0600 (tightened when an older version left them
wider): the cached KV is users' prompts in another form.

Invariants:
- After reopening (even after kill -9 mid-write), every object is either intact or absent:
  `open` drops records whose meta and data disagree, and every read verifies the xxh3-64 of the
  payload; a mismatch deletes the object and reads as a miss.
- `used` is the page-rounded sum of payloads and never exceeds `capacity`; the lmdb map is
  sized with headroom (`MAP_FACTOR`) so b-tree pages and free-list fragmentation fit.
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
from typing import Any, Callable, Iterator

import lmdb
import xxhash

from kvpool.contract import check_stored_key as check_key
from kvpool.errors import CapacityError, InvalidArgument, KeyNotFound, ObjectTooLarge
from kvpool.tiers.allocator import pages_for
from kvpool.shm.views import readable_view, writable_view
from kvpool.tiers.stats import TierStats

log = logging.getLogger(__name__)

META = struct.Struct("<4sHHQQ")
MAGIC = b"KVSS"
VERSION = 1
MAP_FACTOR = 2  # lmdb map = capacity * MAP_FACTOR + MAP_SLACK (sparse file; costs nothing unused)
MAP_SLACK = 64 << 20
COPY_BLOCK = 256 << 10  # fits in L2 next to the hash state


def _lmdb_key(key: str) -> bytes:
    return xxhash.xxh3_128_digest(key.encode("utf-8", "surrogatepass"))


def _copy_and_hash(dst: memoryview, src: memoryview) -> int:
    """Copy `src` into `dst` and return the xxh3-64 of the bytes copied. Large objects go in
    blocks so each block is hashed while it is still in cache (one pass over DRAM, not two)."""
    n = len(src)
    if n <= COPY_BLOCK:
        dst[:n] = src
        return xxhash.xxh3_64_intdigest(dst[:n])
    h = xxhash.xxh3_64()
    for start in range(0, n, COPY_BLOCK):
        end = min(n, start + COPY_BLOCK)
        dst[start:end] = src[start:end]
        h.update(dst[start:end])
    return h.intdigest()


def _accounted(nbytes: int) -> int:
    return pages_for(nbytes) * 4096


# The cached KV is users' prompts in another form: only the node's own user may read it.
DIR_MODE = 0o700
FILE_MODE = 0o600


def _private_dir(path: str) -> None:
    """Create `path` 0700, or tighten it to 0700 when it exists and is ours (an operator's
    directory we do not own is left alone, and lmdb's files in it are still 0600)."""
    os.makedirs(path, mode=DIR_MODE, exist_ok=True)
    st = os.stat(path)
    if st.st_uid == os.getuid() and st.st_mode & 0o777 != DIR_MODE:
        os.chmod(path, DIR_MODE)


def _private_files(path: str) -> None:
    """lmdb creates its files with `mode`; files left by an older version (0644) are tightened."""
    for name in os.listdir(path):
        full = os.path.join(path, name)
        try:
            st = os.stat(full)
            if st.st_uid == os.getuid() and st.st_mode & 0o777 & ~FILE_MODE:
                os.chmod(full, FILE_MODE)
        except OSError:
            pass


LOCK_FILE_BYTES = 64 << 10  # more than lmdb's reader table for max_readers=512 (~33 KiB)


def _reserve_lock_file(path: str) -> None:
    """Allocate lmdb's lock file before lmdb maps it: lmdb writes it through a shared mapping, and
    on a full filesystem that is SIGBUS; allocated here, a full disk is an OSError (ENOSPC)."""
    fd = os.open(os.path.join(path, "lock.mdb"), os.O_RDWR | os.O_CREAT, FILE_MODE)
    try:
        os.posix_fallocate(fd, 0, LOCK_FILE_BYTES)
    finally:
        os.close(fd)


class DiskFull(CapacityError):
    """The filesystem under the SSD tier refused a write, though the tier's own account had room
    (the disk is full or failing); the object is not stored, and freeing tier space does not help."""


class SsdTier:
    """Objects in an lmdb environment at `path` holding up to `capacity` bytes of payload."""

    name = "ssd"

    def __init__(self, path: str, capacity: int):
        if not isinstance(capacity, int) or capacity <= 0:
            raise InvalidArgument(f"SSD capacity must be a positive int, got {capacity!r}")
        self.path = path
        self._capacity = capacity
        # One owner per environment: a second node on the same path would desync our index.
        try:
            _private_dir(path)
            self._lock_fd = os.open(os.path.join(path, "kvpool.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise InvalidArgument(f"cannot use {path!r} for the SSD tier: {exc.strerror}") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise InvalidArgument(f"SSD tier {path} is in use by another process") from None
        self._index: dict[str, tuple[int, int]] = {}  # key -> (payload length, xxh3-64)
        self._used = 0
        try:
            _reserve_lock_file(path)
            # No writemap: lmdb would write through a shared mapping of a sparse file, and a full
            # filesystem answers that with SIGBUS (the node dies); written with pwrite, it is ENOSPC.
            self.env = lmdb.open(path, map_size=capacity * MAP_FACTOR + MAP_SLACK, max_dbs=2, writemap=False,
                                 sync=False, metasync=False, lock=True, max_readers=512, mode=FILE_MODE)
            _private_files(path)
            self._meta = self.env.open_db(b"meta")
            self._data = self.env.open_db(b"data")
            self._recover()
        except (lmdb.Error, OSError) as exc:
            os.close(self._lock_fd)
            raise InvalidArgument(f"cannot open the SSD tier at {path}: {exc}") from None
        except BaseException:
            os.close(self._lock_fd)
            raise

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def used(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._index)

    def _recover(self) -> None:
        """Rebuild the index; drop any object whose two records disagree (cannot normally
        happen, since both are written in one transaction, but a damaged file must not crash us)."""
        bad: list[bytes] = []
        with self.env.begin(buffers=True) as txn:
            for lkey, meta in txn.cursor(db=self._meta):
                parsed = self._parse_meta(meta)
                data = txn.get(lkey, db=self._data)
                if parsed is None or data is None or len(data) != parsed[1] or _lmdb_key(parsed[0]) != bytes(lkey):
                    bad.append(bytes(lkey))
                    continue
                self._index[parsed[0]] = (parsed[1], parsed[2])
                self._used += _accounted(parsed[1])
            for lkey, _ in txn.cursor(db=self._data):
                if txn.get(lkey, db=self._meta) is None:
                    bad.append(bytes(lkey))
        if bad:
            log.warning("ssd tier %s: dropping %d damaged objects on open", self.path, len(bad))
            with self.env.begin(write=True) as txn:
                for lkey in bad:
                    txn.delete(lkey, db=self._meta)
                    txn.delete(lkey, db=self._data)

    @staticmethod
    def _parse_meta(meta: Any) -> tuple[str, int, int] | None:
        if len(meta) < META.size:
            return None
        magic, version, key_len, length, checksum = META.unpack_from(meta, 0)
        if magic != MAGIC or version != VERSION or len(meta) != META.size + key_len:
            return None
        try:
            key = check_key(bytes(meta[META.size :]).decode("utf-8", "surrogatepass"))
        except (UnicodeDecodeError, InvalidArgument):  # a damaged record, or a key no put could write
            return None
        return key, length, checksum

    def room_for(self, nbytes: int) -> bool:
        return self._used + _accounted(nbytes) <= self._capacity

    def put(self, key: str, data: Any) -> None:
        src = readable_view(data)
        check_key(key)
        if key in self._index:
            return
        if _accounted(src.nbytes) > self._capacity:
            raise ObjectTooLarge(f"object of {src.nbytes} bytes exceeds the SSD tier ({self._capacity} bytes)")
        if not self.room_for(src.nbytes):
            raise CapacityError(f"SSD tier full ({self._used}/{self._capacity} bytes)")
        kb = key.encode("utf-8", "surrogatepass")
        checksum = xxhash.xxh3_64_intdigest(src)
        meta = META.pack(MAGIC, VERSION, len(kb), src.nbytes, checksum) + kb
        lkey = _lmdb_key(key)
        try:
            with self.env.begin(write=True) as txn:
                txn.put(lkey, src, db=self._data)
                txn.put(lkey, meta, db=self._meta)
        except lmdb.MapFullError:
            raise CapacityError(f"SSD tier {self.path}: lmdb map full (fragmented); evict and retry") from None
        except lmdb.Error as exc:  # the filesystem refused the write (ENOSPC, EIO): nothing was committed
            raise DiskFull(f"SSD tier {self.path}: the write failed: {exc}") from None
        self._index[key] = (src.nbytes, checksum)
        self._used += _accounted(src.nbytes)

    def _read(self, key: str, out: Any | None) -> bytes | int | None:
        """Copy the payload out (into `out` if given), verifying its checksum; None on a miss.

        The checksum and length come from the in-memory index (parsed from the meta record when
        the object was written or the tier reopened), so a read touches one lmdb record."""
        meta = self._index.get(key)
        if meta is None:
            return None
        length, checksum = meta
        with self.env.begin(buffers=True) as txn:
            data = txn.get(_lmdb_key(key), db=self._data)
            if data is None or len(data) != length:
                damaged = True  # the index promised it: the record is gone or cut short
                result: bytes | int | None = None
            elif out is None:
                result = bytes(data)
                damaged = xxhash.xxh3_64_intdigest(result) != checksum
            else:
                dst = writable_view(out, length)[:length]
                damaged = _copy_and_hash(dst, data) != checksum
                result = length
        if damaged:
            log.warning("ssd tier %s: object %r failed its checksum; dropping it", self.path, key)
            self.remove(key)
            return None
        return result

    def get(self, key: str) -> bytes | None:
        return self._read(check_key(key), None)  # type: ignore[return-value]

    def get_into(self, key: str, buffer: Any) -> int:
        check_key(key)
        result = self._read(key, buffer)  # a small buffer raises InvalidArgument, not a miss
        if result is None:
            raise KeyNotFound(key)
        return result  # type: ignore[return-value]

    def contains(self, key: str) -> bool:
        return check_key(key) in self._index

    def size_of(self, key: str) -> int | None:
        meta = self._index.get(check_key(key))
        return None if meta is None else meta[0]

    def remove(self, key: str) -> bool:
        check_key(key)
        lkey = _lmdb_key(key)
        with self.env.begin(write=True) as txn:
            found = txn.delete(lkey, db=self._meta)
            txn.delete(lkey, db=self._data)
        meta = self._index.pop(key, None)
        if meta is not None:
            self._used -= _accounted(meta[0])
        return found or meta is not None

    def keys(self) -> Iterator[tuple[str, int]]:
        return iter([(k, n) for k, (n, _) in self._index.items()])

    def close(self) -> None:
        if self._lock_fd < 0:
            return
        self.env.close()
        os.close(self._lock_fd)  # releases the flock
        self._lock_fd = -1


class SsdShelf:
    """The SSD tier as DRAM's overflow in a `TieredStore`: the tier, its eviction policy and its
    counters, kept in step (a key is in the policy iff the tier holds it)."""

    def __init__(self, tier: SsdTier, policy: Any, stats: TierStats):
        self.tier = tier
        self.policy = policy
        self.stats = stats
        for key, size in tier.keys():  # objects that survived a restart
            policy.insert(key, size)

    def put(self, key: str, view: memoryview, size: int, evictable: Callable[[str], bool]) -> tuple[bool, list[str]]:
        """Store a demoted object, evicting others (those `evictable`) to make room:
        (stored, the keys evicted on the way)."""
        evicted: list[str] = []
        if size > self.tier.capacity:
            return False, evicted
        while True:
            if self.tier.room_for(size):
                try:
                    self.tier.put(key, view)
                except DiskFull:  # evicting more would not help: this object is not stored
                    return False, evicted
                except CapacityError:  # lmdb map fragmented: free more and retry
                    pass
                else:
                    self.policy.insert(key, size)
                    self.stats.bytes_in += size
                    return True, evicted
            victim = self.policy.evict(evictable)
            if victim is None:
                return False, evicted
            self.tier.remove(victim)
            self.stats.evictions += 1
            evicted.append(victim)

    def drop(self, key: str) -> None:
        """Forget `key` (removed, or its copy was found damaged)."""
        if self.tier.contains(key):
            self.tier.remove(key)
        self.policy.remove(key)
