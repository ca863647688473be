"""The active side of the TCP transport: slices, connection threads, pipelined requests.

Per peer (host, port) there is one queue of slices and `connections_per_peer` threads, each
owning one socket (connected lazily). A thread takes a slice, sends its request, and while
responses are outstanding takes more slices and sends them too (up to `PIPELINE_DEPTH`
requests in flight), so a connection never sits idle for a round trip. Payloads go out with `sendmsg([header, view])`
and come in with `recv_into(view, MSG_WAITALL)` straight into the caller's buffer.

Invariants:
- every slice put on a peer queue is completed exactly once (`batch._slice_done`), with an
  error if the peer failed, timed out, or answered with an error status;
- a connection-level failure (reset, EOF, timeout, garbage reply) fails that connection's
  in-flight slices and every slice still queued for the peer, so a dead or stopped peer costs
  each affected op at most about one `timeout`, never a hang.

Access: with a `credential` (principal, secret) every connection opens with `transfer.auth`'s
handshake; an op's grant (`Op.grant`) rides with each of its slices (`wire.FLAG_GRANT`). A
reply with req_id 0 and an error status is the server refusing the connection (no
authentication, a connection cap): raised as the connection's error.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import socket
import struct
import threading
import time

from transfer import framing, wire
from transfer.auth import AuthError, AuthLimited, NotHandshake, client_handshake
from transfer.batch import Batch, Op
from transfer.descriptor import SegmentDescriptor
from transfer.errors import AccessDenied, LimitReached, PeerUnavailable, ProtocolError, TransferError
from transfer.grant import SIZE as GRANT_SIZE

log = logging.getLogger("transfer.tcp")

_STOP = None
PIPELINE_DEPTH = 4  # 2..8 measured alike at >= 1 MiB; deeper helps 64 KiB slices a little
STALE_CHECK_S = 1.0  # a connection quiet this long is checked for a close by the server before reuse


# A slice: (batch, op index, opcode, local byte view, remote seg_id, remote offset, grant or None)
Slice = tuple


class TcpTransport:
    name = "tcp"

    def __init__(self, timeout: float, connections_per_peer: int, slice_bytes: int,
                 credential: tuple[str, bytes] | None = None):
        self.credential = credential
        self.timeout = timeout
        self.connections_per_peer = max(1, connections_per_peer)
        self.slice_bytes = max(1, slice_bytes)
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._lock = threading.Lock()

    def usable(self, desc: SegmentDescriptor) -> bool:
        return "tcp" in desc.transports and desc.port > 0

    def submit(self, batch: Batch, work: list[tuple[int, Op, memoryview]]) -> None:
        step = self.slice_bytes
        per_peer: dict[tuple[str, int], list[Slice]] = {}
        for index, op, view in work:
            seg_id = op.remote.seg_id
            slices = per_peer.setdefault((op.remote.host, op.remote.port), [])
            length = op.length
            if length == 0:
                continue
            grant = op.grant
            for start in range(0, length, step):
                stop = min(start + step, length)
                slices.append((batch, index, op.opcode, view[start:stop], seg_id, op.remote_offset + start, grant))
        total = sum(len(s) for s in per_peer.values())
        batch._expect(total)
        for addr, slices in per_peer.items():
            self._peer(addr).put(slices)

    def run_inline(self, op: Op, view: memoryview) -> None:
        """Move one op on the calling thread (no hand-off): the sync `read`/`write` fast path."""
        self._peer((op.remote.host, op.remote.port)).run_inline(op, view)

    def _peer(self, addr: tuple[str, int]) -> "_Peer":
        peer = self._peers.get(addr)
        if peer is None:
            with self._lock:
                peer = self._peers.get(addr)
                if peer is None:
                    peer = self._peers[addr] = _Peer(addr, self)
        return peer

    def close(self) -> None:
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            peer.close()


class _Peer:
    """Slices bound for one remote data server, and the threads that move them."""

    def __init__(self, addr: tuple[str, int], transport: TcpTransport):
        self.addr = addr
        self.transport = transport
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.conns: list[_Conn] = []
        self._idle_inline: list[_Conn] = []
        self._lock = threading.Lock()
        self._closed = False

    def put(self, slices: list[Slice]) -> None:
        if not self.conns:
            with self._lock:
                if not self.conns and not self._closed:
                    self.conns = [_Conn(self, i, threaded=True) for i in range(self.transport.connections_per_peer)]
        for s in slices:
            self.queue.put(s)
        if self._closed:
            self.fail_queued(PeerUnavailable("transfer engine closed"))

    def fail_queued(self, error: BaseException) -> None:
        """Fail every slice still waiting for this peer (the peer is gone or not answering)."""
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                return
            if item is _STOP:
                self.queue.put(_STOP)  # not ours to consume; let a thread see it
                return
            item[0]._slice_done(item[1], error)

    def run_inline(self, op: Op, view: memoryview) -> None:
        with self._lock:
            conn = self._idle_inline.pop() if self._idle_inline else None
        reused = conn is not None
        if conn is None:
            conn = _Conn(self, -1, threaded=False)
        step = self.transport.slice_bytes
        seg_id = op.remote.seg_id
        start = 0
        try:
            while start < op.length:
                stop = min(start + step, op.length)
                try:
                    conn.roundtrip(op.opcode, view[start:stop], seg_id, op.remote_offset + start, op.grant)
                except PeerUnavailable:
                    # An idle pooled connection may have been closed by a restarted peer: retry
                    # once on a fresh one (READ and WRITE of the same range are idempotent).
                    if not reused:
                        raise
                    log.debug("stale connection to %s:%d; reconnecting", *self.addr)
                    conn.close()
                    reused = False
                    continue
                reused = False
                start = stop
        except BaseException:
            conn.close()
            raise
        with self._lock:
            if not self._closed:
                self._idle_inline.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self.conns = self.conns, []
            inline, self._idle_inline = self._idle_inline, []
        for _ in conns:
            self.queue.put(_STOP)
        for conn in conns:
            conn.interrupt()  # a thread blocked on a silent peer must not hold up close()
        for conn in conns:
            conn.join()
        for conn in inline:
            conn.close()
        self.fail_queued(PeerUnavailable("transfer engine closed"))


class _Conn:
    """One socket to the peer. Threaded conns serve the peer queue; inline ones serve callers."""

    def __init__(self, peer: _Peer, index: int, threaded: bool):
        self.peer = peer
        self.sock: socket.socket | None = None
        self.hdr = bytearray(wire.REQ.size)
        self.granted_hdr = bytearray(wire.REQ.size + GRANT_SIZE)
        self.resp = bytearray(wire.RESP.size)
        self.resp_view = memoryview(self.resp)
        self.ids = itertools.count(1)
        self.used = 0.0  # when a request was last sent (`peer_closed` checks after STALE_CHECK_S of quiet)
        self._sock_lock = threading.Lock()
        self._interrupted = False
        self.thread = None
        if threaded:
            self.thread = threading.Thread(target=self._loop, daemon=True,
                                           name=f"transfer-tcp-{peer.addr[1]}-{index}")
            self.thread.start()

    # -- socket --------------------------------------------------------------------------
    def connect(self) -> socket.socket:
        if self.sock is None:
            timeout = self.peer.transport.timeout
            try:
                sock = socket.create_connection(self.peer.addr, timeout=timeout)
            except OSError as exc:
                raise wire.map_os_error(exc, f"connect to {self.peer.addr[0]}:{self.peer.addr[1]}") from exc
            framing.tune(sock, timeout, wire.SOCK_BUF)
            credential = self.peer.transport.credential
            if credential is not None:
                authenticate(sock, credential, self.peer.addr, timeout)
            with self._sock_lock:
                if self._interrupted:
                    sock.close()
                    raise PeerUnavailable("transfer engine closed")
                self.sock = sock
        return self.sock

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            finally:
                self.sock = None

    def interrupt(self) -> None:
        """Unblock the thread (and keep it from connecting again): the engine is closing."""
        with self._sock_lock:
            self._interrupted = True
            sock = self.sock
            if sock is not None:
                framing.shutdown(sock)

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join(timeout=self.peer.transport.timeout + 1)
        self.close()

    # -- one request / response ------------------------------------------------------------
    def send(self, opcode: int, view: memoryview, seg_id: int, offset: int, grant: bytes | None = None) -> int:
        req_id = next(self.ids)
        self.used = time.monotonic()
        if grant is None:
            head, flags = self.hdr, 0
        else:
            head, flags = self.granted_hdr, wire.FLAG_GRANT  # with the grant: one send for a READ
            head[wire.REQ.size:] = grant
        wire.REQ.pack_into(head, 0, wire.MAGIC, wire.VERSION, opcode, flags, seg_id, req_id, offset,
                           len(view))
        if opcode == wire.OP_WRITE:
            framing.send_all(self.sock, [head, view])
        else:
            self.sock.sendall(head)
        return req_id

    def recv(self, opcode: int, view: memoryview, req_id: int) -> BaseException | None:
        """Read one response; return the op-level error it carries (None if OK).

        Connection-level problems (EOF, timeout, garbage) raise instead.
        """
        sock = self.sock
        framing.recv_exact_into(sock, self.resp_view)
        magic, version, status, _, got_id, length = wire.RESP.unpack_from(self.resp)
        if magic == wire.MAGIC and got_id == 0 and status != wire.OK and length <= wire.MAX_CONTROL:
            body = bytearray(length)  # the server refuses this connection, and closes it
            framing.recv_exact_into(sock, memoryview(body))
            raise wire.status_error(status, f"{self.peer.addr[0]}:{self.peer.addr[1]}: "
                                            f"{body.decode(errors='replace')}")
        if magic != wire.MAGIC or got_id != req_id:
            raise ProtocolError(f"bad response from {self.peer.addr} (magic {magic:#x}, id {got_id} != {req_id})")
        if status != wire.OK:
            if length > wire.MAX_CONTROL:
                raise ProtocolError(f"error reply of {length} bytes from {self.peer.addr}")
            body = bytearray(length)
            framing.recv_exact_into(sock, memoryview(body))
            err = wire.status_error(status, body.decode(errors="replace"))
            if status in (wire.E_VERSION, wire.E_BAD_REQUEST):
                raise err  # the server closes the connection after these
            return err
        if opcode == wire.OP_READ:
            if length != len(view):
                raise ProtocolError(f"READ reply of {length} bytes, asked {len(view)}")
            framing.recv_exact_into(sock, view)
        return None

    def roundtrip(self, opcode: int, view: memoryview, seg_id: int, offset: int, grant: bytes | None = None) -> None:
        try:
            self.connect()
            err = self.recv(opcode, view, self.send(opcode, view, seg_id, offset, grant))
        except OSError as exc:
            raise wire.map_os_error(exc, f"{self.peer.addr[0]}:{self.peer.addr[1]}") from exc
        if err is not None:
            raise err

    # -- the thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        q = self.peer.queue
        inflight: collections.deque = collections.deque()
        while True:
            item = q.get()
            if item is _STOP:
                self.close()
                return
            if self.sock is not None and time.monotonic() - self.used > STALE_CHECK_S and \
                    framing.peer_closed(self.sock):
                self.close()  # the server closed it while we were idle (its idle timeout): reconnect
            stop = False
            # Slices taken off the queue but not in `inflight` yet: a WRITE waits here while READ
            # responses are due, because sending its payload could block against a server that
            # is itself blocked sending us those responses (a deadlock until the timeout).
            held: list = [item]
            reads = 0  # READs in flight
            try:
                self.connect()
                while held or inflight:
                    if held and (held[0][2] != wire.OP_WRITE or reads == 0) and len(inflight) < PIPELINE_DEPTH:
                        nxt = held[0]
                        req_id = self.send(nxt[2], nxt[3], nxt[4], nxt[5], nxt[6])
                        held.pop()
                        inflight.append((nxt, req_id))
                        reads += nxt[2] == wire.OP_READ
                        continue
                    if not held and not stop and len(inflight) < PIPELINE_DEPTH:
                        try:
                            nxt = q.get_nowait()
                        except queue.Empty:
                            nxt = False
                        if nxt is _STOP:
                            stop = True
                        elif nxt is not False:
                            held.append(nxt)
                            continue
                    done, req_id = inflight[0]
                    err = self.recv(done[2], done[3], req_id)
                    inflight.popleft()
                    reads -= done[2] == wire.OP_READ
                    done[0]._slice_done(done[1], err)
            except BaseException as exc:
                if isinstance(exc, OSError):
                    error = wire.map_os_error(exc, f"{self.peer.addr[0]}:{self.peer.addr[1]}")
                elif isinstance(exc, TransferError):
                    error = exc
                else:  # a bug: still never leave a slice unfinished
                    log.exception("transfer thread error")
                    error = TransferError(f"internal error: {exc!r}")
                log.info("connection to %s:%d failed: %s", *self.peer.addr, error)
                self.close()
                for pending in held:
                    pending[0]._slice_done(pending[1], error)
                while inflight:
                    done, _ = inflight.popleft()
                    done[0]._slice_done(done[1], error)
                self.peer.fail_queued(error)
            if stop:
                self.close()
                return

def authenticate(sock: socket.socket, credential: tuple[str, bytes], addr: tuple, timeout: float) -> None:
    """Prove `credential` on a new data connection (channel "transfer"); `AccessDenied` if refused,
    `LimitReached` if the server closed it at a connection limit first."""
    where = f"{addr[0]}:{addr[1]}"
    try:
        client_handshake(sock, credential[0], credential[1], "transfer", timeout=min(timeout, 10.0))
    except AuthLimited as exc:
        sock.close()
        raise LimitReached(f"{where}: {exc}") from None
    except NotHandshake as exc:  # a response frame in place of the handshake: the server's refusal
        try:
            raise _refusal(sock, exc.first, where) from None
        finally:
            sock.close()
    except AuthError as exc:
        sock.close()
        raise AccessDenied(f"{where}: {exc}") from None


def _refusal(sock: socket.socket, first: bytes, where: str) -> Exception:
    """The error of a response frame (req_id 0: the whole connection refused) sent in place of the
    handshake's answer."""
    try:
        sock.settimeout(2.0)
        head = first + sock.recv(wire.RESP.size - len(first), socket.MSG_WAITALL)
        magic, _version, status, _, _req, length = wire.RESP.unpack(head)
        if magic != wire.MAGIC or length > 1 << 16:
            raise ValueError("not a response frame")
        message = sock.recv(length, socket.MSG_WAITALL).decode("utf-8", "replace")
    except (OSError, ValueError, struct.error) as exc:
        return AccessDenied(f"{where}: the server answered the authentication hello with neither the handshake "
                            f"nor a refusal ({exc})")
    return wire.status_error(status, f"{where}: {message}")


def control_call(addr: tuple[str, int], msg: object, timeout: float,
                 credential: tuple[str, bytes] | None = None) -> object:
    """One control request on a fresh connection (connection set-up, not the data path)."""
    body = wire.CONTROL_ENCODER.encode(msg)
    hdr = bytearray(wire.REQ.size)
    wire.REQ.pack_into(hdr, 0, wire.MAGIC, wire.VERSION, wire.OP_CONTROL, 0, 0, 1, 0, len(body))
    try:
        with socket.create_connection(addr, timeout=timeout) as sock:
            framing.tune(sock, timeout, wire.SOCK_BUF)
            if credential is not None:
                authenticate(sock, credential, addr, timeout)
            framing.send_all(sock, [hdr, body])
            resp = bytearray(wire.RESP.size)
            framing.recv_exact_into(sock, memoryview(resp))
            magic, _version, status, _, req, length = wire.RESP.unpack_from(resp)
            if magic != wire.MAGIC or length > wire.MAX_CONTROL:
                raise ProtocolError(f"bad control reply from {addr}")
            payload = bytearray(length)
            framing.recv_exact_into(sock, memoryview(payload))
            if req == 0 and status != wire.OK:
                raise wire.status_error(status, f"{addr[0]}:{addr[1]}: {payload.decode(errors='replace')}")
    except OSError as exc:
        raise wire.map_os_error(exc, f"control call to {addr[0]}:{addr[1]}") from exc
    try:
        reply = wire.CONTROL_DECODER.decode(payload)
    except Exception as exc:
        raise ProtocolError(f"undecodable control reply from {addr}: {exc}") from exc
    if isinstance(reply, wire.ControlError):
        raise TransferError(f"{addr[0]}:{addr[1]} refused: {reply.message}")
    return reply
