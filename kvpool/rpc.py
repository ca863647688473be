"""The pool's RPC: framed msgpack messages with a raw payload, over TCP on persistent connections.

Frame: a 16-byte header `<HHIQ` = (protocol version, flags, message length, payload length),
then the message (msgpack of a `kvpool.messages` struct), then the payload bytes. Payloads are
read straight into their destination (`recv_into` a store's arena or the caller's buffer) and
sent straight from their source (`sendmsg` of memoryviews), so bulk bytes are never copied into
a Python `bytes` on the way.

Server: one thread per connection (blocking sockets: on loopback this beats an event loop by
tens of microseconds per call). A handler gets `(msg, payload, conn)` and returns a reply
message, a `(reply, buffers)` pair, or None when it already called `conn.reply` itself (to send
while holding a pin). Whatever payload a handler leaves unread is drained, so the stream stays in
frame. A `KVPoolError` becomes an `Err` reply; any other exception is logged and becomes an
`internal` error; either way the connection and the server keep serving.

Invariants: at most one request is outstanding on a connection; a one-way frame
(`FLAG_ONEWAY`) gets no reply; a frame with a wrong version or an undecodable message gets an
`Err` and, since the stream can no longer be trusted, the connection is closed.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
from typing import Any, Callable, Sequence

import msgspec

from kvpool.errors import InvalidArgument, KVPoolError, Unavailable, error_from_code
from kvpool.messages import PROTOCOL_VERSION, Err, Reply, Request

log = logging.getLogger(__name__)

HEADER = struct.Struct("<HHIQ")
FLAG_ONEWAY = 1
MAX_MESSAGE = 64 << 20
MAX_PAYLOAD = 1 << 36
_IOV_MAX = 512  # stay well under the kernel's IOV_MAX per sendmsg
_SOCKBUF = 0  # 0: leave the kernel autotuning alone

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def parse_address(address: str) -> tuple[str, int]:
    """"host:port" -> (host, port), with a typed error for anything else."""
    if not isinstance(address, str) or ":" not in address:
        raise InvalidArgument(f"address must be host:port, got {address!r}")
    host, _, port = address.rpartition(":")
    try:
        port_n = int(port)
    except ValueError:
        raise InvalidArgument(f"address must be host:port, got {address!r}") from None
    if not host or not 0 < port_n < 65536:
        raise InvalidArgument(f"address must be host:port, got {address!r}")
    return host.strip("[]"), port_n


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF) if _SOCKBUF else ():
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, _SOCKBUF)
        except OSError:
            pass


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k


def send_all(sock: socket.socket, buffers: Sequence[Any]) -> None:
    """Send every buffer in order with as few `sendmsg` calls as the kernel allows."""
    views = [v if isinstance(v, memoryview) else memoryview(v) for v in buffers]
    views = [v.cast("B") if v.format != "B" or v.ndim != 1 else v for v in views if v.nbytes]
    i = 0
    while i < len(views):
        sent = sock.sendmsg(views[i:i + _IOV_MAX])
        while sent:
            head = views[i]
            if sent >= len(head):
                sent -= len(head)
                i += 1
            else:
                views[i] = head[sent:]
                sent = 0


def _frame(msg: Any, payload_len: int, flags: int = 0) -> list[Any]:
    body = _encoder.encode(msg)
    return [HEADER.pack(PROTOCOL_VERSION, flags, len(body), payload_len), body]


class Payload:
    """The payload of the frame being handled; read it once, in order, or leave it to be drained."""

    __slots__ = ("_sock", "length", "remaining")

    def __init__(self, sock: socket.socket, length: int):
        self._sock = sock
        self.length = length
        self.remaining = length

    def read_into(self, view: memoryview) -> None:
        if len(view) > self.remaining:
            raise InvalidArgument(f"payload is shorter than announced ({self.remaining} < {len(view)})")
        recv_exact_into(self._sock, view)
        self.remaining -= len(view)

    def read(self, n: int | None = None) -> bytearray:
        buf = bytearray(self.remaining if n is None else n)
        self.read_into(memoryview(buf))
        return buf

    def skip(self, n: int) -> None:
        """Discard the next n bytes (an item the handler refused)."""
        n = min(n, self.remaining)
        scratch = memoryview(bytearray(min(n, 1 << 20) or 1))
        while n:
            k = min(n, len(scratch))
            recv_exact_into(self._sock, scratch[:k])
            self.remaining -= k
            n -= k

    def drain(self) -> None:
        self.skip(self.remaining)


class ServerConn:
    """One accepted connection, as a handler sees it."""

    def __init__(self, sock: socket.socket, peer: str):
        self.sock = sock
        self.peer = peer
        self.replied = False
        self.oneway = False
        self.state: dict[str, Any] = {}  # per-connection handler state (e.g. pins to drop on close)

    def reply(self, msg: Any, buffers: Sequence[Any] = ()) -> None:
        if self.oneway:
            return
        nbytes = sum(memoryview(b).nbytes for b in buffers)
        send_all(self.sock, _frame(msg, nbytes) + list(buffers))
        self.replied = True


Handler = Callable[[Any, Payload, ServerConn], Any]


class RpcServer:
    """Serve `handlers` (message type -> handler) on host:port (0: a free port)."""

    def __init__(self, handlers: dict[type, Handler], host: str = "127.0.0.1", port: int = 0, name: str = "rpc",
                 on_close: Callable[[ServerConn], None] | None = None):
        self.handlers = handlers
        self.name = name
        self.on_close = on_close
        try:
            self._sock = socket.create_server((host, port), backlog=256, reuse_port=False)
        except OSError as exc:
            raise Unavailable(f"{name}: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        # Listening on every interface: advertise this machine's address, not 0.0.0.0.
        self.host = host if host not in ("0.0.0.0", "::", "") else socket.gethostbyname(socket.gethostname())
        self.port = self._sock.getsockname()[1]
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> "RpcServer":
        self._thread = threading.Thread(target=self._accept_loop, name=f"{self.name}-accept", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, peer = self._sock.accept()
            except OSError:
                return
            _tune(sock)
            with self._lock:
                self._conns.add(sock)
            threading.Thread(target=self._serve, args=(sock, f"{peer[0]}:{peer[1]}"),
                             name=f"{self.name}-conn", daemon=True).start()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        conn = ServerConn(sock, peer)
        header = bytearray(HEADER.size)
        hview = memoryview(header)
        try:
            while True:
                try:
                    recv_exact_into(sock, hview)
                except (ConnectionError, OSError):
                    return
                version, flags, msg_len, payload_len = HEADER.unpack(header)
                if version != PROTOCOL_VERSION or msg_len > MAX_MESSAGE or payload_len > MAX_PAYLOAD:
                    conn.oneway = False
                    conn.reply(Err("invalid_argument", f"bad frame: protocol version {version} (this server speaks "
                                   f"{PROTOCOL_VERSION}), message {msg_len} bytes, payload {payload_len} bytes"))
                    return
                body = bytearray(msg_len)
                recv_exact_into(sock, memoryview(body))
                payload = Payload(sock, payload_len)
                conn.oneway = bool(flags & FLAG_ONEWAY)
                conn.replied = False
                try:
                    msg = _request_decoder.decode(body)
                except msgspec.DecodeError as exc:
                    payload.drain()
                    conn.reply(Err("invalid_argument", f"malformed message: {exc}"))
                    continue
                self._dispatch(msg, payload, conn)
        except (ConnectionError, OSError) as exc:
            log.debug("%s: connection from %s ended: %s", self.name, peer, exc)
        finally:
            with self._lock:
                self._conns.discard(sock)
            if self.on_close is not None:
                try:
                    self.on_close(conn)
                except Exception:
                    log.exception("%s: on_close failed", self.name)
            sock.close()

    def _dispatch(self, msg: Any, payload: Payload, conn: ServerConn) -> None:
        handler = self.handlers.get(type(msg))
        try:
            if handler is None:
                raise InvalidArgument(f"{self.name} does not serve {type(msg).__name__}")
            out = handler(msg, payload, conn)
        except KVPoolError as exc:
            out = Err(exc.code, str(exc))
        except (ConnectionError, OSError):
            raise
        except Exception as exc:  # a bug in one handler must not take the server down
            log.exception("%s: %s failed", self.name, type(msg).__name__)
            out = Err("internal", f"{type(exc).__name__}: {exc}")
        if payload.remaining:
            payload.drain()
        if conn.replied or out is None:
            return
        if isinstance(out, tuple):
            conn.reply(out[0], out[1])
        else:
            conn.reply(out)


class RpcClient:
    """One persistent connection to an `RpcServer`. Not thread-safe: one call at a time.

    `call` returns the reply message (an `Err` reply is raised as its typed error); the reply's
    payload, if any, is then read with `read_payload_into` / `read_payload` before the next call
    (or is drained automatically). A broken connection raises `Unavailable` and reconnects on
    the next call.
    """

    def __init__(self, address: str, timeout: float = 10.0):
        self.address = address
        self.host, self.port = parse_address(address)
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._header = bytearray(HEADER.size)
        self.payload_left = 0

    def _connect(self) -> socket.socket:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        except OSError as exc:
            raise Unavailable(f"cannot reach {self.address}: {exc.strerror or exc}") from None
        _tune(sock)
        # Blocking mode with kernel timeouts: a Python-level timeout makes the socket non-blocking,
        # and then MSG_WAITALL returns early and a large reply arrives in many pieces.
        sock.settimeout(None)
        tv = struct.pack("ll", int(self.timeout), int((self.timeout % 1) * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        self._sock = sock
        return sock

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None
                self.payload_left = 0

    def _broken(self, exc: BaseException) -> Unavailable:
        self.close()
        return Unavailable(f"connection to {self.address} failed: {exc}")

    def send_oneway(self, msg: Any) -> None:
        sock = self._sock or self._connect()
        if self.payload_left:
            self.skip_payload()
        try:
            send_all(sock, _frame(msg, 0, FLAG_ONEWAY))
        except OSError as exc:
            raise self._broken(exc) from None

    def call(self, msg: Any, buffers: Sequence[Any] = ()) -> Any:
        self.send_request(msg, buffers)
        return self.recv_reply()

    def send_request(self, msg: Any, buffers: Sequence[Any] = ()) -> None:
        """First half of `call`: lets a caller send to several servers before waiting on any."""
        sock = self._sock or self._connect()
        if self.payload_left:
            self.skip_payload()
        try:
            nbytes = sum(memoryview(b).nbytes for b in buffers)
            send_all(sock, _frame(msg, nbytes) + list(buffers))
        except OSError as exc:
            raise self._broken(exc) from None

    def recv_reply(self) -> Any:
        """Second half of `call`: the reply to the request sent last."""
        sock = self._sock
        if sock is None:
            raise Unavailable(f"connection to {self.address} is closed")
        try:
            recv_exact_into(sock, memoryview(self._header))
            version, _flags, msg_len, payload_len = HEADER.unpack(self._header)
            if version != PROTOCOL_VERSION:
                raise ConnectionError(f"server speaks protocol {version}, this client {PROTOCOL_VERSION}")
            body = sock.recv(msg_len, socket.MSG_WAITALL) if msg_len else b""
            if len(body) != msg_len:
                body += self._recv_rest(msg_len - len(body))
        except (OSError, ConnectionError) as exc:
            raise self._broken(exc) from None
        self.payload_left = payload_len
        try:
            reply = _reply_decoder.decode(body)
        except msgspec.DecodeError as exc:
            raise self._broken(exc) from None
        if isinstance(reply, Err):
            if payload_len:
                self.skip_payload()
            raise error_from_code(reply.code, reply.message)
        return reply

    def _recv_rest(self, n: int) -> bytes:
        buf = bytearray(n)
        recv_exact_into(self._sock, memoryview(buf))
        return bytes(buf)

    def read_payload_into(self, view: memoryview) -> None:
        n = len(view)
        if n > self.payload_left:
            raise InvalidArgument(f"reply payload has {self.payload_left} bytes left, asked for {n}")
        try:
            recv_exact_into(self._sock, view)
        except (OSError, ConnectionError) as exc:
            raise self._broken(exc) from None
        self.payload_left -= n

    def read_payload(self, n: int) -> bytes:
        """The next n payload bytes as one `bytes` (one allocation, no extra copy)."""
        if n > self.payload_left:
            raise InvalidArgument(f"reply payload has {self.payload_left} bytes left, asked for {n}")
        try:
            data = self._sock.recv(n, socket.MSG_WAITALL)
            if len(data) != n:  # interrupted or timed out part-way: finish into one buffer
                if not data:
                    raise ConnectionError("peer closed the connection")
                buf = bytearray(n)
                buf[: len(data)] = data
                recv_exact_into(self._sock, memoryview(buf)[len(data):])
                data = bytes(buf)
        except (OSError, ConnectionError) as exc:
            raise self._broken(exc) from None
        self.payload_left -= n
        return data

    def skip_payload(self, n: int | None = None) -> None:
        """Discard the next n payload bytes (all that is left by default)."""
        n = self.payload_left if n is None else min(n, self.payload_left)
        try:
            Payload(self._sock, n).drain()
        except (OSError, ConnectionError) as exc:
            raise self._broken(exc) from None
        self.payload_left -= n
