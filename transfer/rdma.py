"""The RDMA transport's logic: QP set-up over the TCP control channel, slicing, one-sided
READ/WRITE, completion tracking and timeouts. All verbs calls go through `transfer.verbs`
(or a test's fake with the same interface), so everything here runs without a NIC.

Per peer engine there are `qps_per_peer` RC queue pairs; a batch's slices are spread over them
round-robin, at most `MAX_OUTSTANDING` posted per QP (the rest wait in that QP's backlog).
One poller thread drains the shared completion queue.

Invariants:
- every posted or backlogged slice is completed exactly once: by its work completion, by a
  peer failure, or by its deadline (`timeout` after it was posted);
- a completion with an error status, or a timeout, breaks the peer: its QPs are closed (so no
  late DMA lands in a buffer the caller got back) and every slice still on them fails; the
  next submit to that peer sets up new QPs;
- local memory is covered by a registered MR for as long as a slice on it is posted: a
  registered segment's MR if the range lies inside one, else a temporary MR released when
  the op's last slice finishes.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from typing import Any

import numpy as np

from transfer import wire
from transfer.batch import WRITE, Batch, Op
from transfer.descriptor import RdmaEndpoint, SegmentDescriptor
from transfer.errors import PeerUnavailable, TransferError, TransferTimeout

log = logging.getLogger("transfer.rdma")

MAX_OUTSTANDING = 64
CQ_DEPTH = 8192
EXPIRY_CHECK_S = 0.05


def open_transport(engine_name: str, timeout: float, qps_per_peer: int, slice_bytes: int, device: Any = None,
                   gid_index: int = 0, credential: tuple[str, bytes] | None = None) -> "RdmaTransport | None":
    """The engine's RDMA transport, or None when no device can be opened here. `device`: an
    opened device, or the name of one to open (None: the first); `credential`: what the control
    channel proves to peers (the engine's)."""
    if device is None or isinstance(device, str):
        from transfer import verbs

        device = verbs.open_device(device, gid_index=gid_index)
        if device is None:
            return None
    return RdmaTransport(engine_name, device, timeout, qps_per_peer, slice_bytes, credential)


def buffer_address(view: memoryview) -> int:
    """Address of a (possibly read-only) byte view; numpy reads it without copying."""
    if len(view) == 0:
        return 0
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class _Slice:
    __slots__ = ("batch", "index", "wr_id", "write", "addr", "length", "lkey", "raddr", "rkey", "deadline",
                 "peer", "qp", "release")

    def __init__(self, batch, index, write, addr, length, lkey, raddr, rkey, peer, qp, release):
        self.batch, self.index, self.write = batch, index, write
        self.addr, self.length, self.lkey, self.raddr, self.rkey = addr, length, lkey, raddr, rkey
        self.peer, self.qp, self.release = peer, qp, release
        self.wr_id = 0
        self.deadline = 0.0


class _TempMR:
    """A temporary registration for one op's local buffer; closed after its last slice."""

    def __init__(self, mr: Any, slices: int):
        self.mr, self.left = mr, slices
        self.lock = threading.Lock()

    def slice_finished(self) -> None:
        with self.lock:
            self.left -= 1
            last = self.left == 0
        if last:
            self.mr.close()


class _RdmaPeer:
    def __init__(self, key: tuple, qps: list[Any]):
        self.key = key
        self.qps = qps
        self.outstanding = [0] * len(qps)
        self.backlog = [collections.deque() for _ in qps]
        self.next_qp = 0
        self.broken = False


class RdmaTransport:
    name = "rdma"

    def __init__(self, engine_name: str, device: Any, timeout: float, qps_per_peer: int, slice_bytes: int,
                 credential: tuple[str, bytes] | None = None):
        self.engine_name = engine_name
        self.credential = credential
        self.dev = device
        self.timeout = timeout
        self.qps_per_peer = max(1, qps_per_peer)
        self.slice_bytes = slice_bytes
        self.cq = device.create_cq(CQ_DEPTH)
        self._segments: dict[str, Any] = {}  # name -> MR
        self._peers: dict[tuple, _RdmaPeer] = {}
        self._connecting: dict[tuple, threading.Lock] = {}
        self._served: list[Any] = []  # QPs created for peers that connected to us
        self._inflight: dict[int, _Slice] = {}
        self._wr_ids = itertools.count(1)
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._closed = False
        self._poller = threading.Thread(target=self._poll_loop, name=f"transfer-rdma-{engine_name}", daemon=True)
        self._poller.start()

    # -- registration ------------------------------------------------------------------------
    def register(self, name: str, view: memoryview, remote_write: bool = True) -> RdmaEndpoint:
        """Register `view` for remote READ, and remote WRITE unless `remote_write` is False."""
        addr = buffer_address(view)
        mr = self.dev.reg_mr(addr, len(view), remote_write=remote_write)
        with self._lock:
            self._segments[name] = mr
        return RdmaEndpoint(addr=addr, rkey=mr.rkey, writable=remote_write)

    def unregister(self, name: str) -> None:
        with self._lock:
            mr = self._segments.pop(name, None)
        if mr is not None:
            mr.close()

    def usable(self, desc: SegmentDescriptor) -> bool:
        return "rdma" in desc.transports and desc.rdma is not None

    def _local_key(self, addr: int, length: int) -> tuple[int, Any]:
        """The lkey covering [addr, addr + length), and the temporary MR made for it (None: a segment's)."""
        with self._lock:
            for mr in self._segments.values():
                if mr.addr <= addr and addr + length <= mr.addr + mr.length:
                    return mr.lkey, None
        mr = self.dev.reg_mr(addr, max(length, 1))
        return mr.lkey, mr

    # -- connection set-up (active side) ---------------------------------------------------------
    def _peer(self, desc: SegmentDescriptor) -> _RdmaPeer:
        key = (desc.engine, desc.host, desc.port)
        with self._lock:
            peer = self._peers.get(key)
            if peer is not None and not peer.broken:
                return peer
            connecting = self._connecting.setdefault(key, threading.Lock())
        with connecting:  # one handshake per peer at a time; latecomers use its result
            with self._lock:
                peer = self._peers.get(key)
                if peer is not None and not peer.broken:
                    return peer
            return self._connect(key, desc)

    def _connect(self, key: tuple, desc: SegmentDescriptor) -> _RdmaPeer:
        qps = [self.dev.create_qp(self.cq, MAX_OUTSTANDING) for _ in range(self.qps_per_peer)]
        try:
            from transfer.tcp import control_call

            reply = control_call((desc.host, desc.port),
                                 wire.RdmaConnect(engine=self.engine_name, qps=[qp.info() for qp in qps]),
                                 self.timeout, self.credential)
            if not isinstance(reply, wire.RdmaAccept) or len(reply.qps) != len(qps):
                raise TransferError(f"bad rdma handshake reply from {desc.engine}")
            for qp, remote in zip(qps, reply.qps):
                qp.connect(remote)
        except BaseException:
            for qp in qps:
                qp.close()
            raise
        peer = _RdmaPeer(key, qps)
        with self._lock:
            self._peers[key] = peer
        log.info("%s: %d RC queue pairs to %s at %s:%d", self.engine_name, len(qps), *key)
        return peer

    # -- connection set-up (passive side, called by the data server's control channel) ------------
    def handle_control(self, msg: object) -> object:
        if not isinstance(msg, wire.RdmaConnect):
            return wire.ControlError(f"unexpected control message {type(msg).__name__}")
        if msg.version != wire.VERSION:
            return wire.ControlError(f"rdma handshake version {msg.version}, we speak {wire.VERSION}")
        qps = [self.dev.create_qp(self.cq, 1) for _ in msg.qps]
        try:
            for qp, remote in zip(qps, msg.qps):
                qp.connect(remote)
        except BaseException:
            for qp in qps:
                qp.close()
            raise
        with self._lock:
            self._served.extend(qps)
        return wire.RdmaAccept(qps=[qp.info() for qp in qps])

    # -- transfers -----------------------------------------------------------------------------
    def submit(self, batch: Batch, work: list[tuple[int, Op, memoryview]]) -> None:
        step = self.slice_bytes
        counts = [-(-op.length // step) for _, op, _ in work]  # slices per op (none for an empty one)
        batch._expect(sum(counts))
        for (index, op, view), count in zip(work, counts):
            if count == 0:
                continue
            try:
                peer = self._peer(op.remote)
                addr = buffer_address(view)
                lkey, temp = self._local_key(addr, op.length)
            except BaseException as exc:
                error = exc if isinstance(exc, TransferError) else PeerUnavailable(f"rdma set-up failed: {exc}")
                for _ in range(count):
                    batch._slice_done(index, error)
                continue
            release = _TempMR(temp, count).slice_finished if temp is not None else None
            write = op.opcode == WRITE
            base = op.remote.rdma.addr + op.remote_offset
            for k, start in enumerate(range(0, op.length, step)):
                length = min(step, op.length - start)
                with self._lock:
                    qp_index = peer.next_qp
                    peer.next_qp = (qp_index + 1) % len(peer.qps)
                s = _Slice(batch, index, write, addr + start, length, lkey, base + start, op.remote.rdma.rkey,
                           peer, qp_index, release)
                self._post_or_queue(s)

    def _post_or_queue(self, s: _Slice) -> None:
        peer = s.peer
        with self._lock:
            if peer.broken:
                error = PeerUnavailable(f"rdma connection to {peer.key[0]} is broken")
            elif peer.outstanding[s.qp] >= MAX_OUTSTANDING:
                peer.backlog[s.qp].append(s)
                return
            else:
                error = self._post_locked(s)
        if error is not None:
            self._finish(s, error)

    def _post_locked(self, s: _Slice) -> BaseException | None:
        s.wr_id = next(self._wr_ids)
        s.deadline = time.monotonic() + self.timeout
        self._inflight[s.wr_id] = s
        s.peer.outstanding[s.qp] += 1
        try:
            s.peer.qps[s.qp].post(s.wr_id, s.write, s.addr, s.length, s.lkey, s.raddr, s.rkey)
        except Exception as exc:
            del self._inflight[s.wr_id]
            s.peer.outstanding[s.qp] -= 1
            return PeerUnavailable(f"rdma post failed: {exc}")
        self._wake.set()
        return None

    def _finish(self, s: _Slice, error: BaseException | None) -> None:
        if s.release is not None:
            s.release()
        s.batch._slice_done(s.index, error)

    # -- completions ---------------------------------------------------------------------------
    def _poll_loop(self) -> None:
        idle = 0
        next_expiry = time.monotonic() + EXPIRY_CHECK_S
        while not self._closed:
            if not self._inflight:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            completions = self.cq.poll(64)
            for wr_id, ok, status in completions:
                self._complete(wr_id, None if ok else TransferError(f"rdma work completion failed: {status}"))
            now = time.monotonic()
            if now >= next_expiry:  # by the clock: a busy peer must not keep a silent one alive
                next_expiry = now + EXPIRY_CHECK_S
                self._expire()
            if completions:
                idle = 0
                continue
            idle += 1
            # Busy-poll briefly, then back off: two cores are shared with the data path.
            time.sleep(0 if idle < 64 else 0.0002)

    def _complete(self, wr_id: int, error: BaseException | None) -> None:
        with self._lock:
            s = self._inflight.pop(wr_id, None)
            if s is None:
                return  # late completion of a slice already failed by timeout or a broken peer
            peer = s.peer
            peer.outstanding[s.qp] -= 1
            nxt = peer.backlog[s.qp].popleft() if peer.backlog[s.qp] and not peer.broken else None
            post_error = self._post_locked(nxt) if nxt is not None else None
        self._finish(s, error)
        if nxt is not None and post_error is not None:
            self._finish(nxt, post_error)
        if error is not None:
            self._break(peer, error)

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            late = {s.peer.key: s.peer for s in self._inflight.values() if s.deadline < now}
        for peer in late.values():
            self._break(peer, TransferTimeout(f"rdma peer {peer.key[0]} did not complete within {self.timeout}s"))

    def _break(self, peer: _RdmaPeer, error: BaseException) -> None:
        """Fail everything on `peer`'s QPs and close them (no late DMA into returned buffers)."""
        with self._lock:
            if peer.broken and not any(s.peer is peer for s in self._inflight.values()):
                return
            peer.broken = True
            if self._peers.get(peer.key) is peer:
                del self._peers[peer.key]
            victims = [s for s in self._inflight.values() if s.peer is peer]
            for s in victims:
                del self._inflight[s.wr_id]
            for q in peer.backlog:
                victims.extend(q)
                q.clear()
        log.warning("%s: rdma peer %s failed: %s (%d slices)", self.engine_name, peer.key[0], error, len(victims))
        for qp in peer.qps:
            try:
                qp.close()
            except Exception:
                log.debug("closing a broken QP failed", exc_info=True)
        for s in victims:
            self._finish(s, error)

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._poller.join(timeout=2)
        with self._lock:
            peers = list(self._peers.values())
        for peer in peers:
            self._break(peer, PeerUnavailable("transfer engine closed"))
        with self._lock:
            served, self._served = self._served, []
            mrs, self._segments = list(self._segments.values()), {}
        for qp in served:
            qp.close()
        for mr in mrs:
            mr.close()
        self.cq.close()
