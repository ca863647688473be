"""FAKE verbs layer for tests: imitates transfer/verbs.py's interface inside one process.

This is a fake, not RDMA. It exists because this machine cannot have an RDMA device (no
InfiniBand support in its kernel, no Soft-RoCE), and it lets the logic in transfer/rdma.py
(handshake over the real TCP control channel, slicing over QPs, completion tracking, timeouts,
error completions) run for real. A "one-sided" op is a `ctypes.memmove` between memory
registered in the same process, checked against the remote MR's bounds like a NIC would.

A `FakeFabric` connects the `FakeDevice`s of engines in one process. Failure knobs:
- `fabric.silent.add(dev)`: posts to QPs whose remote end is on `dev` never complete
  (a peer that stopped answering);
- `fabric.fail_with = "IBV_WC_RETRY_EXC_ERR"`: every post completes with that error status.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import threading

from transfer.wire import QPInfo


class FakeFabric:
    def __init__(self) -> None:
        self.qps: dict[int, "FakeQP"] = {}
        self.mrs: dict[int, "FakeMR"] = {}  # rkey -> MR
        self.silent: set["FakeDevice"] = set()
        self.fail_with: str | None = None
        self.posts: collections.Counter = collections.Counter()  # qpn -> posted work requests
        self._ids = itertools.count(0x100)
        self.lock = threading.Lock()

    def next_id(self) -> int:
        with self.lock:
            return next(self._ids)


class FakeMR:
    def __init__(self, dev: "FakeDevice", addr: int, length: int, remote_write: bool = True):
        self.dev, self.addr, self.length = dev, addr, length
        self.remote_write = remote_write
        self.lkey = self.rkey = dev.fabric.next_id()
        self.closed = False
        dev.fabric.mrs[self.rkey] = self
        dev.mrs.add(self)

    def covers(self, addr: int, length: int) -> bool:
        return not self.closed and self.addr <= addr and addr + length <= self.addr + self.length

    def close(self) -> None:
        self.closed = True
        self.dev.fabric.mrs.pop(self.rkey, None)
        self.dev.mrs.discard(self)


class FakeCQ:
    def __init__(self) -> None:
        self.entries: collections.deque = collections.deque()
        self.closed = False

    def poll(self, n: int = 32) -> list[tuple[int, bool, str]]:
        out = []
        while self.entries and len(out) < n:
            out.append(self.entries.popleft())
        return out

    def close(self) -> None:
        self.closed = True


class FakeQP:
    def __init__(self, dev: "FakeDevice", cq: FakeCQ, max_send_wr: int):
        self.dev, self.cq, self.max_send_wr = dev, cq, max_send_wr
        self.qpn = dev.fabric.next_id()
        self.psn = 0
        self.remote: QPInfo | None = None
        self.closed = False
        dev.fabric.qps[self.qpn] = self
        dev.qps.add(self)

    def info(self) -> QPInfo:
        return QPInfo(qpn=self.qpn, psn=self.psn, lid=1, gid=bytes(16), mtu=4096)

    def connect(self, remote: QPInfo) -> None:
        if remote.qpn not in self.dev.fabric.qps:
            raise RuntimeError(f"fake: no QP {remote.qpn} on the fabric")
        self.remote = remote

    def post(self, wr_id: int, write: bool, local_addr: int, length: int, lkey: int,
             remote_addr: int, rkey: int) -> None:
        fabric = self.dev.fabric
        if self.closed or self.remote is None:
            raise RuntimeError("fake: post on a closed or unconnected QP")
        fabric.posts[self.qpn] += 1
        peer = fabric.qps.get(self.remote.qpn)
        if peer is None or peer.closed:
            self.cq.entries.append((wr_id, False, "IBV_WC_RETRY_EXC_ERR"))
            return
        if peer.dev in fabric.silent:
            return  # never completes
        if fabric.fail_with:
            self.cq.entries.append((wr_id, False, fabric.fail_with))
            return
        local = fabric.mrs.get(lkey)
        remote = fabric.mrs.get(rkey)
        if local is None or local.dev is not self.dev or not local.covers(local_addr, length):
            self.cq.entries.append((wr_id, False, "IBV_WC_LOC_PROT_ERR"))
            return
        if remote is None or remote.dev is not peer.dev or not remote.covers(remote_addr, length) or \
                (write and not remote.remote_write):
            self.cq.entries.append((wr_id, False, "IBV_WC_REM_ACCESS_ERR"))
            return
        if write:
            ctypes.memmove(remote_addr, local_addr, length)
        else:
            ctypes.memmove(local_addr, remote_addr, length)
        self.cq.entries.append((wr_id, True, "IBV_WC_SUCCESS"))

    def close(self) -> None:
        self.closed = True
        self.dev.qps.discard(self)


class FakeDevice:
    """A fake RDMA device on `fabric` (see module docstring)."""

    def __init__(self, fabric: FakeFabric, name: str = "fake0"):
        self.fabric, self.name = fabric, name
        self.mrs: set[FakeMR] = set()
        self.qps: set[FakeQP] = set()
        self.closed = False

    def reg_mr(self, addr: int, length: int, remote_write: bool = True) -> FakeMR:
        return FakeMR(self, addr, length, remote_write)

    def create_cq(self, depth: int) -> FakeCQ:
        return FakeCQ()

    def create_qp(self, cq: FakeCQ, max_send_wr: int) -> FakeQP:
        return FakeQP(self, cq, max_send_wr)

    def close(self) -> None:
        self.closed = True
