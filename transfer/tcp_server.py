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
stalls mid-frame holds only its own connection thread.
"""

from __future__ import annotations

import logging
import socket
from typing import Callable

from transfer import framing, wire
from transfer.errors import PeerUnavailable, TransferError

log = logging.getLogger("transfer.tcp_server")

class DataServer:
    """Accepts connections on `host:port` and serves `segments` (seg_id -> (name, byte view)).

    `segments` is owned by the engine; the server only reads it (dict reads are atomic).
    `control` handles OP_CONTROL payloads (decoded msgspec message -> reply message).
    """

    def __init__(self, segments: dict[int, tuple[str, memoryview]], host: str, port: int,
                 control: Callable[[object], object] | None = None, name: str = ""):
        self.segments = segments
        self.control = control
        self.name = name
        listener = socket.create_server((host, port), backlog=128)
        self.host, self.port = listener.getsockname()[:2]
        self._listener = framing.Listener([listener], self._serve, f"transfer-{self.port}", None, wire.SOCK_BUF)

    def start(self) -> None:
        self._listener.start()

    def close(self) -> None:
        self._listener.close()

    def _serve(self, conn: socket.socket, addr) -> None:
        try:
            self._serve_frames(conn, addr)
        except (PeerUnavailable, ConnectionError, TimeoutError) as exc:
            log.debug("%s: connection from %s ended: %s", self.name, addr, exc)
        except OSError as exc:
            if not self._listener.closed:
                log.info("%s: connection from %s failed: %s", self.name, addr, exc)
        except Exception:
            log.exception("%s: unexpected error serving %s", self.name, addr)

    def _serve_frames(self, conn: socket.socket, addr) -> None:
        hdr = bytearray(wire.REQ.size)
        hview = memoryview(hdr)
        resp = bytearray(wire.RESP.size)
        segments = self.segments
        while True:
            first = conn.recv_into(hview, len(hview), socket.MSG_WAITALL)
            if first == 0:
                return  # clean close between frames
            if first < len(hview):
                framing.recv_exact_into(conn, hview[first:])
            magic, version, opcode, _, seg_id, req_id, offset, length = wire.REQ.unpack_from(hdr)
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

            if opcode == wire.OP_READ or opcode == wire.OP_WRITE:
                entry = segments.get(seg_id)
                err = seg = None
                if entry is None:
                    err = (wire.E_NO_SEGMENT, f"no segment #{seg_id} on {self.name} (never registered or "
                                              "unregistered since)")
                else:
                    seg = entry[1]
                    if offset + length > len(seg):
                        err = (wire.E_RANGE, f"[{offset}, {offset + length}) outside segment "
                                             f"{entry[0]!r} of {len(seg)} bytes")
                if opcode == wire.OP_WRITE:
                    if err is None:
                        framing.recv_exact_into(conn, seg[offset:offset + length])
                    else:
                        framing.drain(conn, length)
                if err is not None:
                    self._reply_error(conn, resp, req_id, *err)
                    continue
                if opcode == wire.OP_READ:
                    wire.RESP.pack_into(resp, 0, wire.MAGIC, wire.VERSION, wire.OK, 0, req_id, length)
                    framing.send_all(conn, [resp, seg[offset:offset + length]])
                else:
                    wire.RESP.pack_into(resp, 0, wire.MAGIC, wire.VERSION, wire.OK, 0, req_id, 0)
                    conn.sendall(resp)
            elif opcode == wire.OP_PING:
                framing.drain(conn, length)
                wire.RESP.pack_into(resp, 0, wire.MAGIC, wire.VERSION, wire.OK, 0, req_id, 0)
                conn.sendall(resp)
            elif opcode == wire.OP_CONTROL:
                if length > wire.MAX_CONTROL:
                    self._reply_error(conn, resp, req_id, wire.E_BAD_REQUEST, "control message too large")
                    return
                payload = bytearray(length)
                framing.recv_exact_into(conn, memoryview(payload))
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
