"""A client's connection to one store node: reads over TCP or, on the same host, through shm.

Same-host reads map the node's arena file and its DRAM index (`kvpool.tiers.shm_index`)
read-only once. A get first looks each key up in the index and copies it out of the mapping,
validated after the copy: no round trip at all; such reads are reported to the node in batches
(`NodeUnpin.touched`, one-way) so hits and eviction recency stay right. Keys the index does not
serve (absent, in SSD, just changed) cost one round trip to pin (`NodePin`; objects up to
32 KiB come back inline instead), one memcpy out of the mapping, and an unpin that rides on the
next request to that node (or a one-way `NodeUnpin` from `flush`), so it costs no extra round
trip. Other reads are one `NodeGet` round trip whose reply payload is
received straight into the result (`recv` into a new `bytes`, or `recv_into` the caller's buffer).

The node's transfer segment (for the engine data path, `kvpool.client.engine_path`) is learned
from the embedded pool's hello, a `NodeStats` answer or a `Slots` reply, and kept.

Not thread-safe: the owning client serializes calls.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
from typing import Any, Sequence

from kvpool.errors import InvalidArgument
from kvpool.messages import Err, NodeGet, NodePin, NodeStats, NodeUnpin, NodeWrite, Placed
from kvpool.rpc import RpcClient, parse_address
from kvpool.tiers import shm_index
from kvpool.tiers.arena import populate

log = logging.getLogger(__name__)

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
MAX_PENDING_UNPINS = 256
MAX_PENDING_TOUCHES = 64  # index reads reported to the node per one-way message
POPULATE_MAX = 16 << 30  # map a node's arena into our page tables up front up to this size
TOO_SMALL = -2  # get_many_into: the caller's buffer cannot hold the object
BATCH_SLURP_MAX = 256 * 1024  # a batch reply up to this size is received in one piece
_UNKNOWN = object()  # transfer segment not learned yet


class NodeConn:
    def __init__(self, address: str, rpc: RpcClient | None = None, *, timeout: float = 10.0, use_shm: bool = True,
                 shm_path: str | None = None, hostname: str | None = None, arena_size: int | None = None,
                 segment: bytes | None = None, index_path: str | None = None):
        self.address = address
        self.rpc = rpc or RpcClient(address, timeout=timeout)
        self.unpins: list[int] = []
        self.touched: list[str] = []
        self._mmap: mmap.mmap | None = None
        self.arena: memoryview | None = None
        self.index: shm_index.ShmIndexReader | None = None
        self._segment: Any = _UNKNOWN
        if segment is not None or shm_path is not None:  # the hello told us
            self.remember_segment(segment)
        if use_shm:
            if shm_path is None:
                info = self.rpc.call(NodeStats()).doc
                shm_path, hostname, arena_size = info.get("shm_path"), info.get("hostname"), info.get("arena_size")
                index_path = info.get("index_path")
                self.remember_segment(info.get("transfer_segment"))
                if hostname == socket.gethostname():
                    self.rpc.use_unix(info.get("unix"))  # same host: the node's unix socket
            self._map(shm_path, hostname, arena_size)
            if self.arena is not None and index_path and shm_index.supported():
                try:
                    self.index = shm_index.ShmIndexReader(index_path)
                except (OSError, InvalidArgument) as exc:
                    log.info("node %s: not using its shm index %s (%s)", self.address, index_path, exc)

    def transfer_segment(self):
        """The node's arena as a `transfer.SegmentDescriptor`, or None when it has no engine."""
        if self._segment is _UNKNOWN:
            self.remember_segment(self.rpc.call(NodeStats()).doc.get("transfer_segment"))
        return self._segment

    def remember_segment(self, raw: bytes | None) -> None:
        if raw is None:
            self._segment = None
            return
        from transfer import SegmentDescriptor, TransferError

        try:
            self._segment = SegmentDescriptor.from_bytes(raw)
        except TransferError as exc:
            log.warning("node %s published an unreadable transfer segment (%s); using its RPC", self.address, exc)
            self._segment = None

    def _map(self, shm_path: str | None, hostname: str | None, size: int | None) -> None:
        host, _ = parse_address(self.address)
        same_host = hostname == socket.gethostname() and (host in _LOOPBACK or host == socket.gethostbyname(hostname))
        if not (same_host and shm_path and size):
            return
        try:
            fd = os.open(shm_path, os.O_RDONLY)
        except OSError:
            return  # another host with the same name, or the node moved: TCP it is
        try:
            if os.fstat(fd).st_size != size:
                return
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            self.arena = memoryview(self._mmap)
            if size <= POPULATE_MAX:  # its page tables cost 2 MiB per GiB of arena
                populate(self._mmap, size, write=False)
            log.debug("reading node %s through shm %s", self.address, shm_path)
        finally:
            os.close(fd)

    @property
    def shm(self) -> bool:
        return self.arena is not None

    def _take_unpins(self) -> list[int]:
        out, self.unpins = self.unpins, []
        return out

    take_unpins = _take_unpins

    def release_pins(self) -> None:
        """Unpin now and wait for the node to have done it (before a remove of what we read)."""
        if self.unpins:
            self.rpc.call(NodePin([], self._take_unpins()))

    def flush(self) -> None:
        """Send pending unpins and index-read reports now (one-way)."""
        if self.unpins or self.touched:
            touched, self.touched = self.touched, []
            self.rpc.send_oneway(NodeUnpin(self._take_unpins(), touched))

    def _from_index(self, keys: Sequence[str], views: Sequence[memoryview] | None, out: list) -> list[int]:
        """Serve what the shm index can into out[i] (bytes, or the size copied into views[i],
        or TOO_SMALL); returns the indexes left for the node. See `kvpool.tiers.shm_index`."""
        index, arena = self.index, self.arena
        assert index is not None and arena is not None
        limit = len(arena)
        todo: list[int] = []
        served: list[str] = []
        for i, key in enumerate(keys):
            hit = index.find(key)
            if hit is None:
                todo.append(i)
                continue
            slot, seq, offset, n = hit
            if offset + n > limit:  # a torn read of an entry being changed
                todo.append(i)
                continue
            if views is None:
                value: Any = bytes(arena[offset:offset + n])
            elif n > len(views[i]):
                value = TOO_SMALL
            else:
                views[i][:n] = arena[offset:offset + n]
                value = n
            if not index.still(slot, seq):  # changed during the copy: what we copied may be anything
                todo.append(i)
                continue
            out[i] = value
            if value is not TOO_SMALL:
                served.append(key)
        if served:
            self.touched += served
            if len(self.touched) >= MAX_PENDING_TOUCHES:
                self.flush()
        return todo

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if self.index is not None:
            out: list[bytes | None] = [None] * len(keys)
            todo = self._from_index(keys, None, out)
            if todo:
                for i, value in zip(todo, self._get_many([keys[i] for i in todo])):
                    out[i] = value
            return out
        return self._get_many(keys)

    def _get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if self.arena is not None:
            pins = self.rpc.call(NodePin(list(keys), self._take_unpins()))
            arena, cur = self.arena, _Cursor(self.rpc, sum(1 for o in pins.offsets if o < 0))
            out = [None if n < 0 else cur.take(n) if o < 0 else bytes(arena[o:o + n])
                   for o, n in zip(pins.offsets, pins.sizes)]
            self._unpin_later(pins.pin_id)
            return out
        data = self.rpc.call(NodeGet(list(keys)))
        cur = _Cursor(self.rpc, len(data.sizes))
        return [cur.take(n) if n >= 0 else None for n in data.sizes]

    def get_into(self, key: str, view: memoryview) -> int:
        """Copy one object into `view`; -1 on a miss. InvalidArgument if `view` is too small."""
        n = self.get_many_into([key], [view])[0]
        if n == TOO_SMALL:
            raise InvalidArgument(f"buffer holds {len(view)} bytes, the object {key!r} needs more")
        return n

    def get_many_into(self, keys: Sequence[str], views: Sequence[memoryview]) -> list[int]:
        """Copy each object into its view: its size, -1 on a miss, TOO_SMALL if the view is."""
        if self.index is not None:
            got = [-1] * len(keys)
            todo = self._from_index(keys, views, got)
            if todo:
                for i, n in zip(todo, self._get_many_into([keys[i] for i in todo], [views[i] for i in todo])):
                    got[i] = n
            return got
        return self._get_many_into(keys, views)

    def _get_many_into(self, keys: Sequence[str], views: Sequence[memoryview]) -> list[int]:
        out: list[int] = []
        if self.arena is not None:
            pins = self.rpc.call(NodePin(list(keys), self._take_unpins()))
            cur = _Cursor(self.rpc, sum(1 for o in pins.offsets if o < 0))
            try:
                for view, n, offset in zip(views, pins.sizes, pins.offsets):
                    if n > len(view):
                        if offset < 0:
                            cur.skip(n)
                        out.append(TOO_SMALL)
                    elif n >= 0 and offset < 0:
                        cur.into(view[:n])
                        out.append(n)
                    else:
                        if n >= 0:
                            view[:n] = self.arena[offset:offset + n]
                        out.append(n)
            finally:
                self._unpin_later(pins.pin_id)
            return out
        data = self.rpc.call(NodeGet(list(keys)))
        cur = _Cursor(self.rpc, len(data.sizes))
        for view, n in zip(views, data.sizes):
            if n > len(view):
                cur.skip(n)
                out.append(TOO_SMALL)
            else:
                if n >= 0:
                    cur.into(view[:n])
                out.append(n)
        return out

    def _unpin_later(self, pin_id: int) -> None:
        if pin_id:
            self.unpins.append(pin_id)
            if len(self.unpins) >= MAX_PENDING_UNPINS:
                self.flush()

    unpin_later = _unpin_later

    def write(self, keys: Sequence[str], sizes: Sequence[int], put_ids: Sequence[int], views: Sequence[Any],
              replicas: int = 0) -> list[Placed | Err]:
        self.start_write(keys, sizes, put_ids, views, replicas)
        return self.finish_write()

    def start_write(self, keys: Sequence[str], sizes: Sequence[int], put_ids: Sequence[int], views: Sequence[Any],
                    replicas: int = 0) -> None:
        """Send a write without waiting, so writes to several replicas overlap."""
        self.rpc.send_request(NodeWrite(list(keys), list(sizes), list(put_ids), replicas), views)

    def finish_write(self) -> list[Placed | Err]:
        return self.rpc.recv_reply().results

    def close(self) -> None:
        try:
            self.flush()
        except Exception:  # the node may be gone; its pins expire by themselves
            pass
        self.rpc.close()
        if self.index is not None:
            self.index.close()
            self.index = None
        if self.arena is not None:
            self.arena.release()
            self.arena = None
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None


class _Cursor:
    """Hands out a reply payload piece by piece. Several small pieces are received with one
    `recv` and sliced (a syscall per 4 KiB object costs more than copying it); large ones go
    straight from the socket into their destination."""

    def __init__(self, rpc: RpcClient, pieces: int):
        self.rpc = rpc
        self.blob: memoryview | None = None
        self.pos = 0
        if pieces > 1 and 0 < rpc.payload_left <= BATCH_SLURP_MAX:
            self.blob = memoryview(rpc.read_payload(rpc.payload_left))

    def take(self, n: int) -> bytes:
        if self.blob is None:
            return self.rpc.read_payload(n)
        self.pos += n
        return bytes(self.blob[self.pos - n:self.pos])

    def into(self, view: memoryview) -> None:
        if self.blob is None:
            self.rpc.read_payload_into(view)
            return
        n = len(view)
        view[:] = self.blob[self.pos:self.pos + n]
        self.pos += n

    def skip(self, n: int) -> None:
        if self.blob is None:
            self.rpc.skip_payload(n)
        else:
            self.pos += n
