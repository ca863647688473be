"""The same-host transport: the remote segment is a /dev/shm file we map; an op is a memcpy.

Invariants:
- a segment is used through shm only when its descriptor offers "shm", names a `shm_path`,
  and comes from this kernel (`host_id`); the mapping is cached per (engine, path), so a
  restarted owner (new engine name) never reuses a stale mapping;
- the owner's liveness (pid) is checked at most every `LIVENESS_S` seconds per owner (the
  check reads /proc, which would cost more than a 64 KiB copy): ops to an owner known dead
  fail with `PeerUnavailable` rather than read memory nobody maintains;
- shm ops complete during `submit` (a memcpy cannot wait on a peer), so they never time out.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import time

from transfer.batch import READ, Batch, Op
from transfer.descriptor import SegmentDescriptor, pid_alive
from transfer.route import same_host
from transfer.errors import InvalidOp, PeerUnavailable, TransferError

log = logging.getLogger("transfer.shm")

SHM_DIR = "/dev/shm"
LIVENESS_S = 0.05


def create_shm_buffer(size: int) -> tuple[mmap.mmap, str]:
    """Create a shared-memory file of `size` bytes and map it; returns (mapping, path).

    Register the mapping with `engine.register(mapping, shm_path=path)`; the caller owns the
    file and removes it (`os.unlink(path)`) when done.
    """
    if size <= 0:
        raise InvalidOp(f"shm buffer size must be positive, got {size}")
    path = os.path.join(SHM_DIR, f"kvpool-transfer-{os.getpid()}-{os.urandom(4).hex()}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return mapping, path


class ShmTransport:
    name = "shm"

    def __init__(self) -> None:
        self._maps: dict[tuple[str, str], tuple[mmap.mmap, memoryview]] = {}
        self._lock = threading.Lock()
        self._alive: dict[int, tuple[float, bool]] = {}  # pid -> (checked at, alive)
        self._openable: dict[str, bool] = {}  # shm path -> whether this process may map it

    def _owner_alive(self, pid: int) -> bool:
        now = time.monotonic()
        seen = self._alive.get(pid)
        if seen is not None and (not seen[1] or now - seen[0] < LIVENESS_S):
            return seen[1]
        alive = pid_alive(pid)
        self._alive[pid] = (now, alive)
        return alive

    def usable(self, desc: SegmentDescriptor) -> bool:
        """Offered, on this host, and a file we may open: segments are 0600, so a process of
        another uid on the same host goes over tcp (where the owner's grants are checked)."""
        if not ("shm" in desc.transports and desc.shm_path and same_host(desc.host_id)):
            return False
        ok = self._openable.get(desc.shm_path)
        if ok is None:
            ok = self._openable[desc.shm_path] = os.access(desc.shm_path, os.R_OK | os.W_OK)
        return ok

    def view(self, desc: SegmentDescriptor) -> memoryview:
        """Our (cached) mapping of the segment's file, as a byte view."""
        key = (desc.engine, desc.shm_path)
        entry = self._maps.get(key)
        if entry is None:
            with self._lock:
                entry = self._maps.get(key)
                if entry is None:
                    entry = self._maps[key] = self._map(desc)
        return entry[1]

    @staticmethod
    def _map(desc: SegmentDescriptor) -> tuple[mmap.mmap, memoryview]:
        try:
            fd = os.open(desc.shm_path, os.O_RDWR)
        except OSError as exc:
            raise PeerUnavailable(f"cannot open {desc.shm_path} of segment {desc.name!r}: {exc}") from exc
        try:
            actual = os.fstat(fd).st_size
            if actual < desc.size:
                raise PeerUnavailable(f"{desc.shm_path} has {actual} bytes, segment {desc.name!r} says {desc.size}")
            mapping = mmap.mmap(fd, desc.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        log.debug("mapped %s (%d bytes) for segment %s/%s", desc.shm_path, desc.size, desc.engine, desc.name)
        return mapping, memoryview(mapping)

    def submit(self, batch: Batch, work: list[tuple[int, Op, memoryview]]) -> None:
        batch._expect(len(work))
        ok = 0  # successes are reported in one call: no per-op lock round trip
        segments: dict[int, memoryview] = {}  # id(descriptor) -> mapping, checked once per submit
        for index, op, local in work:
            error = None
            try:
                desc = op.remote
                seg = segments.get(id(desc))
                if seg is None:
                    if not self._owner_alive(desc.pid):
                        raise PeerUnavailable(f"owner of segment {desc.name!r} (pid {desc.pid}) is gone")
                    seg = segments[id(desc)] = self.view(desc)
                remote = seg[op.remote_offset:op.remote_offset + op.length]
                if op.opcode == READ:
                    local[:] = remote
                else:
                    remote[:] = local
            except TransferError as exc:
                error = exc
            except (OSError, ValueError) as exc:
                error = TransferError(f"shm op {index} failed: {exc}")
            if error is None:
                ok += 1
            else:
                batch._slice_done(index, error)
        if ok:
            batch._slices_ok(ok)

    def close(self) -> None:
        with self._lock:
            entries, self._maps = list(self._maps.values()), {}
        for mapping, view in entries:
            with contextlib.suppress(BufferError):  # a caller still holds a slice: the GC closes it later
                view.release()
                mapping.close()
