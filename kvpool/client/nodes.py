"""A client's connection to one store node: reads over TCP or, on the same host, through shm.

Same-host reads map the node's arena file read-only once; a get is then one round trip to pin
(`NodePin`; objects up to 32 KiB come back inline instead), one memcpy out of the mapping, and an unpin that rides on the next request to that
node (or a one-way `NodeUnpin` from `flush`), so it costs no extra round trip. Other reads are one
`NodeGet` round trip whose reply payload is received straight into the result (`recv` into a new
`bytes`, or `recv_into` the caller's buffer).

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

log = logging.getLogger(__name__)

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
MAX_PENDING_UNPINS = 256


class NodeConn:
    def __init__(self, address: str, rpc: RpcClient | None = None, *, timeout: float = 10.0, use_shm: bool = True,
                 shm_path: str | None = None, hostname: str | None = None, arena_size: int | None = None):
        self.address = address
        self.rpc = rpc or RpcClient(address, timeout=timeout)
        self.unpins: list[int] = []
        self._mmap: mmap.mmap | None = None
        self.arena: memoryview | None = None
        if use_shm:
            if shm_path is None:
                info = self.rpc.call(NodeStats()).doc
                shm_path, hostname, arena_size = info.get("shm_path"), info.get("hostname"), info.get("arena_size")
            self._map(shm_path, hostname, arena_size)

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
            log.debug("reading node %s through shm %s", self.address, shm_path)
        finally:
            os.close(fd)

    @property
    def shm(self) -> bool:
        return self.arena is not None

    def _take_unpins(self) -> list[int]:
        out, self.unpins = self.unpins, []
        return out

    def flush(self) -> None:
        """Send pending unpins now (one-way)."""
        if self.unpins:
            self.rpc.send_oneway(NodeUnpin(self._take_unpins()))

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if self.arena is not None:
            pins = self.rpc.call(NodePin(list(keys), self._take_unpins()))
            arena = self.arena
            out = [None if n < 0 else self.rpc.read_payload(n) if o < 0 else bytes(arena[o:o + n])
                   for o, n in zip(pins.offsets, pins.sizes)]
            self._unpin_later(pins.pin_id)
            return out
        data = self.rpc.call(NodeGet(list(keys)))
        return [self.rpc.read_payload(n) if n >= 0 else None for n in data.sizes]

    def get_into(self, key: str, view: memoryview) -> int:
        """Copy one object into `view`; -1 on a miss. InvalidArgument if `view` is too small."""
        if self.arena is not None:
            pins = self.rpc.call(NodePin([key], self._take_unpins()))
            n, offset = pins.sizes[0], pins.offsets[0]
            try:
                if n > len(view):
                    raise InvalidArgument(f"buffer holds {len(view)} bytes, the object needs {n}")
                if n >= 0 and offset < 0:
                    self.rpc.read_payload_into(view[:n])
                elif n >= 0:
                    view[:n] = self.arena[offset:offset + n]
            finally:
                self._unpin_later(pins.pin_id)
            return n
        data = self.rpc.call(NodeGet([key]))
        n = data.sizes[0]
        if n > len(view):
            self.rpc.skip_payload()
            raise InvalidArgument(f"buffer holds {len(view)} bytes, the object needs {n}")
        if n >= 0:
            self.rpc.read_payload_into(view[:n])
        return n

    def _unpin_later(self, pin_id: int) -> None:
        if pin_id:
            self.unpins.append(pin_id)
            if len(self.unpins) >= MAX_PENDING_UNPINS:
                self.flush()

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
        if self.arena is not None:
            self.arena.release()
            self.arena = None
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None
