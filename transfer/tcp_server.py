"""The passive side of the TCP transport: serves READ/WRITE into registered segments.

One thread per connection (blocking sockets; the data path never touches asyncio). Each
request is validated before any byte of the target moves: a frame with bad magic or an
unreadable header closes that connection (logged), a bad version gets an error reply and a
close, an unknown segment or an out-of-range offset gets an error reply (a WRITE's payload is
drained so the stream stays in sync) and the connection keeps serving. Nothing a client sends
can take down the listener or other connections.

A WRITE whose payload is cut short (the client died mid-frame) leaves that range partly
written; the client sees an error for the op, and callers that need atomic visibility (the
pool's two-phase put) publish a range only after every write to it succeeded. A client that
stalls mid-frame holds only its own connection thread, and only for about a tick
(`framing.Limits`): a header not finished, a body slower than the minimum rate, or a connection
idle past the idle timeout is closed.

With `auth` (principal -> secret), each connection must open with `transfer.auth`'s handshake
(channel "transfer"); one that opens with anything else gets an E_UNAUTHORIZED reply (req_id 0)
and is closed. With `grants`, every READ/WRITE must carry a grant (`transfer.grant`) that covers
it, issued to the principal the connection proved: a missing, forged, expired, other-op,
out-of-range or other principal's grant gets E_FORBIDDEN and nothing moves (a WRITE's payload
is drained, not written). An admitted frame counts as moving bytes under its grant until its
last byte is sent or received (`Grants.admit` / `done`), so the grant's revocation waits for it
or cuts its connection (`transfer.grant`). Without either, anyone who reaches the port may READ
and WRITE any registered byte: the pool then listens on loopback only.
"""

from __future__ import annotations

import logging
import socket
from typing import Callable

from transfer import framing, wire
from transfer.auth import AuthError, AuthLimited, SecretLookup, looks_like_hello, serve_handshake
from transfer.listener import Listener
from transfer.errors import PeerUnavailable, TransferError
from transfer.grant import CUT_STEP, SIZE as GRANT_SIZE, Frame, Grants

log = logging.getLogger("transfer.tcp_server")

HOW_TO_AUTH = ("this transfer engine requires authentication: the client engine needs a credential "
               "(TransferEngine(credential=(principal, secret)); the pool gives it KVPOOL_AUTH_FILE's)")


class DataServer:
    """Accepts connections on `host:port` and serves `segments` (seg_id -> (name, byte view)).

    `segments` is owned by the engine; the server only reads it (dict reads are atomic).
    `control` handles OP_CONTROL payloads (decoded msgspec message -> reply message).
    `auth`: principal -> secret (None: unknown), turns the handshake on; `grants`: turns grant
    checks on; `limits`: per-connection limits and connection caps (`framing.Limits`, enforced by
    `transfer.listener`: with `auth`, unauthenticated and authenticated connections have budgets of
    their own); `uncapped`: a principal not capped per principal (the engine's own: its peers).
    """

    def __init__(self, segments: dict[int, tuple[str, memoryview]], host: str, port: int,
                 control: Callable[[object], object] | None = None, name: str = "",
                 auth: SecretLookup | None = None, grants: Grants | None = None,
                 limits: framing.Limits | None = None, uncapped: str | None = None):
        self.segments = segments
        self.control = control
        self.name = name
        self.auth = auth
        self.grants = grants
        self.limits = limits if limits is not None else framing.Limits()
        self.uncapped = uncapped
        listener = socket.create_server((host, port), backlog=1024)
        self.host, self.port = listener.getsockname()[:2]
        self._listener = Listener([listener], self._serve, f"transfer-{self.port}", None, wire.SOCK_BUF,
                                  limits=self.limits, refusal=self._limit_frame, handshake=auth is not None)

    @staticmethod
    def _limit_frame(message: str) -> bytes:
        body = message.encode()
        return wire.RESP.pack(wire.MAGIC, wire.VERSION, wire.E_LIMIT, 0, 0, len(body)) + body

    def start(self) -> None:
        self._listener.start()

    def close(self) -> None:
        self._listener.close()

    def _serve(self, conn: socket.socket, addr) -> None:
        try:
            self._serve_frames(conn, addr)
        except framing.Stalled as exc:
            log.info("%s: cut the connection from %s: %s", self.name, addr, exc)
        except (PeerUnavailable, ConnectionError, TimeoutError) as exc:
            log.debug("%s: connection from %s ended: %s", self.name, addr, exc)
        except OSError as exc:
            if not self._listener.closed:
                log.info("%s: connection from %s failed: %s", self.name, addr, exc)
        except Exception:
            log.exception("%s: unexpected error serving %s", self.name, addr)

    def _open(self, conn: socket.socket, addr, hview: memoryview) -> tuple[int, str]:
        """Before the first frame: the handshake when this server has `auth` (or when a client
        offers one: it is told there is none). Returns how many header bytes are already read,
        or -1: close the connection (refused, closed, or silent for its first tick); and the
        principal the connection proved ("" without authentication)."""
        if self.auth is None:
            got = self._recv_header(conn, hview[:4], 1)
            if got == 0:  # closed, or silent for a whole tick: a new connection speaks at once
                return -1, ""
            if looks_like_hello(hview[:4]):
                try:
                    serve_handshake(conn, bytes(hview[:4]), None, "transfer")
                except AuthError as exc:
                    log.warning("%s: refused %s: %s", self.name, addr, exc)
                return -1, ""
            return got, ""
        listener = self._listener
        framing.set_io_timeout(conn, listener.handshake_deadline(conn) or 0.001)  # the tick again after
        try:
            got = conn.recv_into(hview[:4], 4, socket.MSG_WAITALL)
        except OSError:
            got = 0
        if got < 4 or not looks_like_hello(hview[:4]):
            why = listener.eviction(conn)
            if why is not None:  # cut at a limit before it spoke: our protocol's refusal
                framing.refuse_after(conn, self._limit_frame(why))
            elif got:
                if got == 4:
                    framing.set_io_timeout(conn, 0.5)
                    got += self._recv_header(conn, hview[4:], 1, started=True)
                req_id = wire.REQ.unpack_from(hview)[5] if got == len(hview) else 0
                log.warning("%s: refused %s: no authentication hello", self.name, addr)
                body = HOW_TO_AUTH.encode()
                framing.refuse_after(conn, wire.RESP.pack(wire.MAGIC, wire.VERSION, wire.E_UNAUTHORIZED, 0, req_id,
                                                          len(body)) + body)
            return -1, ""
        try:
            principal = serve_handshake(conn, bytes(hview[:4]), self.auth, "transfer",
                                        timeout=listener.handshake_deadline(conn),
                                        evicted=lambda: listener.eviction(conn))
        except AuthLimited as exc:
            log.info("%s: closed %s while it authenticated: %s", self.name, addr, exc)
            return -1, ""
        except AuthError as exc:
            log.warning("%s: refused %s: %s", self.name, addr, exc)
            return -1, ""
        why = listener.authenticated(conn, None if principal == self.uncapped else principal)
        if why is not None:
            framing.refuse_after(conn, self._limit_frame(why))
            return -1, ""
        framing.set_io_timeout(conn, self.limits.tick or 0)
        log.debug("%s: %s authenticated as %r", self.name, addr, principal)
        return 0, principal

    def _recv_header(self, conn: socket.socket, view: memoryview, idle_ticks: int, started: bool = False) -> int:
        """Fill `view` (a frame header, or its first bytes); 0: the peer closed or stayed idle
        past the idle timeout before sending a byte. A header once started must finish within
        two ticks (the header timeout)."""
        got, n, late = 0, len(view), 0
        while got < n:
            try:
                k = conn.recv_into(view[got:] if got else view, n - got, socket.MSG_WAITALL)
            except BlockingIOError:  # a tick without a byte
                k = -1
            if k == 0:
                if got or started:
                    raise ConnectionError(f"peer closed the connection mid-header ({got} of {n} bytes)")
                return 0
            if k > 0:
                got += k
            if got < n:
                if got or started:
                    late += 1
                    if late >= 2:
                        raise framing.Stalled(f"header not finished within the header timeout "
                                              f"({self.limits.header_timeout_s}s)")
                elif idle_ticks:
                    idle_ticks -= 1
                    if not idle_ticks:
                        log.debug("%s: closing a connection idle for %ss", self.name, self.limits.idle_timeout_s)
                        return 0
        return got

    def _serve_frames(self, conn: socket.socket, addr) -> None:
        hdr = bytearray(wire.REQ.size)
        hview = memoryview(hdr)
        resp = bytearray(wire.RESP.size)
        segments = self.segments
        grants = self.grants
        grant = bytearray(GRANT_SIZE)
        gview = memoryview(grant)
        idle = self.limits.idle_ticks() or -1  # -1: never idle-closed
        pace = self.limits.min_per_tick
        have, principal = self._open(conn, addr, hview)
        if have < 0:
            return
        frame = Frame(conn, principal)  # the grants it presents must name its principal
        while True:
            if have:
                first, have = have, 0
            else:
                try:
                    first = conn.recv_into(hview, len(hview), socket.MSG_WAITALL)
                except BlockingIOError:  # a tick between frames: count it towards the idle timeout
                    first = self._recv_header(conn, hview, idle)
                    if first == 0:
                        return
                if first == 0:
                    return  # clean close between frames
            if first < len(hview):
                self._recv_header(conn, hview[first:], 0, started=True)
            magic, version, opcode, flags, seg_id, req_id, offset, length = wire.REQ.unpack_from(hdr)
            if magic != wire.MAGIC:
                log.warning("%s: garbage from %s (bad magic %#x); closing that connection", self.name, addr, magic)
                return
            if version != wire.VERSION:
                log.warning("%s: %s speaks protocol version %d, we speak %d", self.name, addr, version, wire.VERSION)
                self._reply_error(conn, resp, req_id, wire.E_VERSION,
                                  f"protocol version {version} not supported (server speaks {wire.VERSION})")
                return
            if length > wire.MAX_FRAME:
                log.warning("%s: oversized frame from %s (length %d); closing", self.name, addr, length)
                self._reply_error(conn, resp, req_id, wire.E_BAD_REQUEST, "frame too large")
                return

            if flags & wire.FLAG_GRANT:
                got = conn.recv_into(gview, GRANT_SIZE, socket.MSG_WAITALL)  # sent with the header: there already
                if got != GRANT_SIZE:
                    framing.recv_paced(conn, gview[got:], 0)
            if opcode == wire.OP_READ or opcode == wire.OP_WRITE:
                err = seg = None
                admitted = False
                if grants is not None:
                    if not flags & wire.FLAG_GRANT:
                        why = "no grant: this engine serves only granted ranges"
                    else:
                        why = grants.admit(grant, opcode, seg_id, offset, length, frame)
                        admitted = why is None
                    if why is not None:
                        log.info("%s: refused %s of [%d, +%d) on #%d from %s: %s", self.name,
                                 "READ" if opcode == wire.OP_READ else "WRITE", offset, length, seg_id, addr, why)
                        err = (wire.E_FORBIDDEN, why)
                try:  # an admitted frame counts as moving bytes under its grant until `done` (`transfer.grant`)
                    if err is None:
                        entry = segments.get(seg_id)
                        if entry is None:
                            err = (wire.E_NO_SEGMENT, f"no segment #{seg_id} on {self.name} (never registered or "
                                                      "unregistered since)")
                        else:
                            seg = entry[1]
                            if offset + length > len(seg):
                                err = (wire.E_RANGE, f"[{offset}, {offset + length}) outside segment "
                                                     f"{entry[0]!r} of {len(seg)} bytes")
                    if opcode == wire.OP_WRITE:
                        if err is not None:
                            framing.drain(conn, length, pace)
                        elif admitted:
                            _recv_granted(conn, seg[offset:offset + length], pace, frame)
                        else:
                            framing.recv_paced(conn, seg[offset:offset + length], pace)
                    elif err is None:
                        wire.RESP.pack_into(resp, 0, wire.MAGIC, wire.VERSION, wire.OK, 0, req_id, length)
                        framing.send_all(conn, [resp, seg[offset:offset + length]])
                finally:
                    if admitted:  # before the WRITE's answer: its writer may end the reservation right after
                        grants.done(frame)
                if err is not None:
                    self._reply_error(conn, resp, req_id, *err)
                elif opcode == wire.OP_WRITE:
                    wire.RESP.pack_into(resp, 0, wire.MAGIC, wire.VERSION, wire.OK, 0, req_id, 0)
                    conn.sendall(resp)
            elif opcode == wire.OP_PING:
                framing.drain(conn, length, pace)
                wire.RESP.pack_into(resp, 0, wire.MAGIC, wire.VERSION, wire.OK, 0, req_id, 0)
                conn.sendall(resp)
            elif opcode == wire.OP_CONTROL:
                if length > wire.MAX_CONTROL:
                    self._reply_error(conn, resp, req_id, wire.E_BAD_REQUEST, "control message too large")
                    return
                payload = bytearray(length)  # at most MAX_CONTROL (1 MiB)
                framing.recv_paced(conn, memoryview(payload), pace)
                reply = self._control(payload)
                body = wire.CONTROL_ENCODER.encode(reply)
                wire.RESP.pack_into(resp, 0, wire.MAGIC, wire.VERSION,
                                    wire.E_BAD_REQUEST if isinstance(reply, wire.ControlError) else wire.OK,
                                    0, req_id, len(body))
                framing.send_all(conn, [resp, body])
            else:
                log.warning("%s: unknown opcode %d from %s; closing", self.name, opcode, addr)
                self._reply_error(conn, resp, req_id, wire.E_BAD_REQUEST, f"unknown opcode {opcode}")
                return

    def _control(self, payload: bytearray) -> object:
        try:
            msg = wire.CONTROL_DECODER.decode(payload)
        except Exception as exc:  # msgspec raises DecodeError/ValidationError
            return wire.ControlError(f"bad control message: {exc}")
        if isinstance(msg, wire.Hello):
            return wire.Hello(engine=self.name)
        if self.control is None:
            return wire.ControlError(f"{type(msg).__name__} not supported here")
        try:
            return self.control(msg)
        except TransferError as exc:
            return wire.ControlError(str(exc))
        except Exception as exc:
            log.exception("%s: control handler failed", self.name)
            return wire.ControlError(f"internal error: {exc}")

    @staticmethod
    def _reply_error(conn: socket.socket, resp: bytearray, req_id: int, status: int, message: str) -> None:
        body = message.encode()
        wire.RESP.pack_into(resp, 0, wire.MAGIC, wire.VERSION, status, 0, req_id, len(body))
        framing.send_all(conn, [resp, body])


def _recv_granted(conn: socket.socket, view: memoryview, pace: int, frame: Frame) -> None:
    """`framing.recv_paced` in steps of `CUT_STEP`, stopping at the first step after the frame's
    grant was revoked (`Frame.cut`): a cut frame stops writing into its range within one step,
    whatever the kernel still delivers (`Grants.revoke` waits for that before the range is reused)."""
    for start in range(0, len(view), CUT_STEP):
        if frame.cut:
            raise ConnectionError("the frame's grant was revoked mid-frame; connection cut")
        framing.recv_paced(conn, view[start:start + CUT_STEP], pace)
