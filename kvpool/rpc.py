"""The pool's RPC: framed msgpack messages with a raw payload, over TCP on persistent connections.

Frame: a 16-byte header `<HHIQ` = (protocol version, flags, message length, payload length),
then the message (msgpack of a `kvpool.messages` struct), then the payload bytes. Payloads are
read straight into their destination (`recv_into` a store's arena or the caller's buffer) and
sent straight from their source (`sendmsg` of memoryviews), so bulk bytes are never copied into
a Python `bytes` on the way.

Same-host clients: on Linux a server also listens on an abstract unix socket
(`RpcServer.unix_address`, "@kvpool-rpc-<port>-<random>", no file to clean up), which it
advertises (hello, node info); a client told to (`RpcClient.use_unix`) moves its connection
there: a 64 KiB round trip costs about half of loopback TCP's. The client keeps its TCP address
as its identity and falls back to TCP if the unix socket cannot be reached.

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
import os
import secrets
import socket
import struct
import sys
import threading
import time
from typing import Any, Callable, Sequence

import msgspec

from kvpool.errors import InvalidArgument, KVPoolError, Unavailable, error_from_code
from kvpool.messages import PROTOCOL_VERSION, Err, Reply, Request

log = logging.getLogger(__name__)

HEADER = struct.Struct("<HHIQ")
FLAG_ONEWAY = 1
FLAG_SPIN = 2  # in a reply: the server sees this client as its only active one (see `_Spin`)
MAX_MESSAGE = 64 << 20
MAX_PAYLOAD = 1 << 36
_IOV_MAX = 512  # stay well under the kernel's IOV_MAX per sendmsg
_SOCKBUF = 0  # 0: leave the kernel autotuning alone
_RBUF = 16 << 10  # a server connection's receive buffer (header, message, payload start)
# Waiting for the next request (server) or for a reply (client), a connection may first poll up
# to N times without blocking (about a microsecond each): on loopback the other side often
# answers within tens of microseconds, and waking a thread that slept (an idle CPU; in a VM, a
# halted vCPU) costs more than that. Adaptive (`_Spin`): a spin that found nothing turns spinning
# off for that connection, a blocking wait short enough for a spin to have covered it turns it
# back on. Never when the other side is in this process: there it needs our GIL to answer.
# Server side (on by default, KVPOOL_SERVER_SPIN=0 turns it off): a connection thread spins for
# the next request only while its client is the only active one: no other connection of this
# process is handling a request or spinning (it stops as soon as one is), and requests of two
# different connections did not follow each other within the last `_MIXED_NS`. With several
# busy clients the server has work anyway, and the clients need the CPU a spin would take.
# Measured here (2 cores, 64 KiB put/get, benchmarks/spin_load.py): one client 2-3x the ops/s
# over TCP and 1.4-1.6x same-host (with the client side below); 4 clients 1.0-1.16x; 16 clients
# 0.79-1.04x (mean 0.95x) with p99 within noise (BENCHMARKS.md).
# Client side (KVPOOL_RPC_SPIN, default 64, 0 turns it off): clients cannot see each other (on
# 2 cores, 4 clients that all spun got 0.85x the throughput with a worse p99), so a client
# spins for a reply only when the server's previous reply carried FLAG_SPIN: the server sets it
# while this client is its only active one, and the same rules as its own spin apply.
_SPIN_POLLS = int(os.environ.get("KVPOOL_RPC_SPIN", "64"))
_SERVER_SPIN_POLLS = int(os.environ.get("KVPOOL_SERVER_SPIN", "64"))
_busy: set[int] = set()  # server connection threads of this process handling a request
_spinning: set[int] = set()  # ... or spinning for one (set.add/discard are atomic under the GIL)
_MIXED_NS = 2_000_000
_SPIN_WORTH_NS = 100_000  # a blocking wait shorter than this turns spinning back on (`_Spin`)
_last = [0, 0, 0]  # thread of the last request, when it came, until when clients count as mixed


def _alone(me: int) -> bool:
    """No connection thread but `me` is handling a request or spinning."""
    return not _busy and _spinning.issubset((me,))


def _request_from(me: int) -> int:
    """Note a request arriving on `me`'s connection; returns the time (ns)."""
    now = time.monotonic_ns()
    last = _last
    if last[0] != me and now - last[1] < _MIXED_NS:
        last[2] = now + _MIXED_NS
    last[0], last[1] = me, now
    return now


def _may_spin(me: int) -> bool:
    return _alone(me) and time.monotonic_ns() > _last[2]


def _sole_client(now: int) -> bool:
    """While handling a request that came at `now`: is this connection the only active one (no
    one else busy or spinning, not mixed lately)? Then its client may spin for our reply
    (FLAG_SPIN)."""
    return len(_busy) == 1 and not _spinning and now > _last[2]


class _Spin:
    """How many non-blocking polls the next wait on one connection may make (0: block at once).

    Adaptive, one sample deep: spin on while spins find data (`won`); a spin that found nothing
    (`lost`) turns it off; while off, each blocking wait is timed (`waited`) and a short one
    (under `_SPIN_WORTH_NS`, which a spin would have covered) turns it back on. So a client
    sending a burst of requests is spun for from its second request, and one that pauses
    between requests longer than a spin costs at most every other wait's spin."""

    __slots__ = ("cap", "polls")

    def __init__(self, cap: int):
        self.cap = cap
        self.polls = cap

    def won(self) -> None:
        self.polls = self.cap

    def lost(self) -> None:
        self.polls = 0

    def waited(self, ns: int) -> None:
        """A blocking wait (with spinning off) took `ns`."""
        self.polls = self.cap if ns < _SPIN_WORTH_NS else 0


_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)
# Between two empty polls: let a runnable thread on this CPU (perhaps the very peer we wait
# for) run first; on an otherwise idle CPU it returns at once.
_yield = getattr(os, "sched_yield", lambda: None)
_WAITALL = getattr(socket, "MSG_WAITALL", 0)
# Payloads of at least this size are received polling (`_recv_polling`) by a server for its sole
# active client, and by a client told so (FLAG_SPIN): measured here, puts of 1 MiB 1.4x and
# 8 MiB 1.36x the GB/s of sleeping in MSG_WAITALL; at 256 KiB no difference. Client side, from
# 2 MiB: 8 MiB get_into 1.2-1.5x, while at 1 MiB it did not help.
_STREAM_SPIN_MIN = 256 << 10
_STREAM_SPIN_MIN_CLIENT = 2 << 20
_SPIN_POLLS_STREAM = 256
_local_clients: set[tuple] = set()  # local (host, port) of this process's RpcClient sockets, ("unix", pid)
_local_servers: set[tuple[str, int]] = set()  # (host, port) this process's RpcServers listen on
_WILDCARD = ("0.0.0.0", "::", "")


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _peer_pid(sock: socket.socket) -> int:
    try:
        return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
    except (OSError, AttributeError):
        return 0


def _serves_locally(peer: tuple[str, int]) -> bool:
    """Is (host, port) one of this process's own RpcServers? (False positives only cost speed.)"""
    return any(port == peer[1] and host in (peer[0], *_WILDCARD) for host, port in list(_local_servers))

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


_UNIX = sys.platform.startswith("linux") and hasattr(socket, "AF_UNIX") \
    and os.environ.get("KVPOOL_RPC_UNIX", "1") != "0"


def _unix_name(address: str) -> str:
    """"@name" (abstract) -> the sockaddr string bind/connect take."""
    return "\0" + address[1:] if address.startswith("@") else address


_UNIX_SNDBUF = 4 << 20  # the kernel caps it at net.core.wmem_max


def _tune(sock: socket.socket) -> None:
    if sock.family == socket.AF_UNIX:
        # A unix stream's sender blocks once `SO_SNDBUF` (default ~208 KiB) is in flight: with
        # the default, a 256 KiB value took several sleep/wake hand-offs between the two sides.
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _UNIX_SNDBUF)
        except OSError:
            pass
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF) if _SOCKBUF else ():
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, _SOCKBUF)
        except OSError:
            pass


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from a blocking socket. MSG_WAITALL: the kernel gathers the pieces (a unix
    socket delivers 64 KiB as two or three) instead of a return to Python per piece."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got, _WAITALL)
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k


def _recv_polling(sock: socket.socket, view: memoryview) -> None:
    """`recv_exact_into`, polling while the bytes stream in: a large payload arrives in many
    pieces, and taking each as it lands (the sender copying on one core, us on the other) beats
    sleeping until MSG_WAITALL is satisfied, which wakes us per piece anyway. Blocks after
    `_SPIN_POLLS_STREAM` empty polls in a row."""
    got, n, misses = 0, len(view), 0
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got, _DONTWAIT)
        except BlockingIOError:
            misses += 1
            if misses < _SPIN_POLLS_STREAM:
                _yield()
                continue
            k = sock.recv_into(view[got:], n - got, _WAITALL)
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k
        misses = 0


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


class _Reader:
    """A connection's receive buffer: one `recv` brings a frame's header, message and the start of
    its payload (a small request, often all of it), instead of one syscall per part."""

    __slots__ = ("sock", "buf", "view", "start", "end")

    def __init__(self, sock: socket.socket, size: int = _RBUF):
        self.sock = sock
        self.buf = bytearray(size)
        self.view = memoryview(self.buf)
        self.start = 0
        self.end = 0

    def fill(self, need: int, spin: "_Spin | None" = None, me: int = 0) -> None:
        """Have at least `need` (<= the buffer's size) unread bytes buffered; with `spin`, first
        poll without blocking as it allows (see `_Spin`); with `me` (a server thread), only
        while `_alone(me)`."""
        if self.end - self.start >= need:
            return
        if self.start:
            if self.start == self.end:
                self.start = self.end = 0
            elif len(self.buf) - self.start < need:
                n = self.end - self.start
                self.buf[:n] = bytes(self.view[self.start:self.end])
                self.start, self.end = 0, n
        view, sock = self.view, self.sock
        polls = spin.polls if spin is not None else 0
        timed = spin is not None and not polls  # spinning is off: time this wait (`_Spin.waited`)
        while self.end - self.start < need:
            if polls:
                if me and not _alone(me):  # another connection needs the CPU: not a miss, just block
                    polls = 0
                    continue
                try:
                    k = sock.recv_into(view[self.end:], 0, _DONTWAIT)
                    spin.won()
                    polls = 0
                except BlockingIOError:
                    polls -= 1
                    if not polls:
                        spin.lost()
                    _yield()
                    continue
            elif timed:
                timed = False
                t0 = time.monotonic_ns()
                k = sock.recv_into(view[self.end:])
                spin.waited(time.monotonic_ns() - t0)
            else:
                k = sock.recv_into(view[self.end:])
            if k == 0:
                raise ConnectionError("peer closed the connection")
            self.end += k

    def take_into(self, view: memoryview) -> int:
        """Copy up to len(view) buffered bytes into `view`; how many were copied."""
        k = min(self.end - self.start, len(view))
        if k:
            view[:k] = self.view[self.start:self.start + k]
            self.start += k
        return k

    def discard(self, n: int) -> int:
        """Drop up to n buffered bytes; how many were dropped."""
        k = min(self.end - self.start, n)
        self.start += k
        return k


class Payload:
    """The payload of the frame being handled; read it once, in order, or leave it to be drained."""

    __slots__ = ("_sock", "length", "remaining", "_reader", "spin")

    def __init__(self, sock: socket.socket, length: int, reader: _Reader | None = None, spin: bool = False):
        self._sock = sock
        self.length = length
        self.remaining = length
        self._reader = reader  # its buffered bytes come first
        self.spin = spin  # the sole active client's: poll for large payloads instead of sleeping

    def read_into(self, view: memoryview) -> None:
        n = len(view)
        if n > self.remaining:
            raise InvalidArgument(f"payload is shorter than announced ({self.remaining} < {n})")
        got = self._reader.take_into(view) if self._reader is not None else 0
        if got < n:
            rest = view[got:] if got else view
            if self.spin and len(rest) >= _STREAM_SPIN_MIN:
                _recv_polling(self._sock, rest)
            else:
                recv_exact_into(self._sock, rest)
        self.remaining -= n

    def read(self, n: int | None = None) -> bytearray:
        buf = bytearray(self.remaining if n is None else n)
        self.read_into(memoryview(buf))
        return buf

    def skip(self, n: int) -> None:
        """Discard the next n bytes (an item the handler refused)."""
        n = min(n, self.remaining)
        if n and self._reader is not None:
            k = self._reader.discard(n)
            self.remaining -= k
            n -= k
        if not n:
            return
        scratch = memoryview(bytearray(min(n, 1 << 20)))
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
        self.flags = 0  # reply flags for the request being handled (FLAG_SPIN)
        self.state: dict[str, Any] = {}  # per-connection handler state (e.g. pins to drop on close)

    def reply(self, msg: Any, buffers: Sequence[Any] = ()) -> None:
        if self.oneway:
            return
        if not buffers:  # most replies: one small frame, one send
            body = _encoder.encode(msg)
            self.sock.sendall(HEADER.pack(PROTOCOL_VERSION, self.flags, len(body), 0) + body)
        else:
            nbytes = sum(memoryview(b).nbytes for b in buffers)
            send_all(self.sock, _frame(msg, nbytes, self.flags) + list(buffers))
        self.replied = True


Handler = Callable[[Any, Payload, ServerConn], Any]


class RpcServer:
    """Serve `handlers` (message type -> handler) on host:port (0: a free port)."""

    def __init__(self, handlers: dict[type, Handler], host: str = "127.0.0.1", port: int = 0, name: str = "rpc",
                 on_close: Callable[[ServerConn], None] | None = None, unix: bool = True):
        """`unix`: also listen on an abstract unix socket for same-host clients (Linux)."""
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
        self._listen_addr = tuple(self._sock.getsockname()[:2])
        _local_servers.add(self._listen_addr)
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._threads: list[threading.Thread] = []
        self.unix_address: str | None = None
        self._unix_sock: socket.socket | None = None
        if unix and _UNIX:
            name = f"@kvpool-rpc-{self.port}-{secrets.token_hex(6)}"
            try:
                usock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                usock.bind(_unix_name(name))
                usock.listen(256)
            except OSError as exc:  # optional: same-host clients use TCP then
                log.info("%s: no unix socket (%s); same-host clients use TCP", name, exc)
            else:
                self._unix_sock, self.unix_address = usock, name

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> "RpcServer":
        for sock in (self._sock, self._unix_sock):
            if sock is not None:
                t = threading.Thread(target=self._accept_loop, args=(sock,), name=f"{self.name}-accept", daemon=True)
                t.start()
                self._threads.append(t)
        return self

    def stop(self) -> None:
        self._closed = True
        _local_servers.discard(self._listen_addr)
        for listener in (self._sock, self._unix_sock):
            if listener is not None:
                _shutdown(listener)
                listener.close()
        with self._lock:
            conns = list(self._conns)
        for s in conns:
            _shutdown(s)  # wakes its thread, which closes it
        for t in self._threads:
            t.join(timeout=5)

    def _accept_loop(self, listener: socket.socket) -> None:
        while not self._closed:
            try:
                sock, peer = listener.accept()
            except OSError:
                return
            _tune(sock)
            with self._lock:
                self._conns.add(sock)
            if sock.family == socket.AF_UNIX:
                pid = _peer_pid(sock)
                # a client in this process needs our GIL to answer: never spin for it
                args = (sock, f"unix:pid {pid}", ("unix", os.getpid()) if pid == os.getpid() else ())
            else:
                args = (sock, f"{peer[0]}:{peer[1]}", tuple(peer[:2]))
            threading.Thread(target=self._serve, args=args, name=f"{self.name}-conn", daemon=True).start()

    def _serve(self, sock: socket.socket, peer: str, peer_addr: tuple = ()) -> None:
        conn = ServerConn(sock, peer)
        reader = _Reader(sock)
        spin = _Spin(0 if peer_addr in _local_clients or peer_addr[:1] == ("unix",) else _SERVER_SPIN_POLLS)
        hsize = HEADER.size
        unpack_from = HEADER.unpack_from
        decode = _request_decoder.decode
        me = threading.get_ident()
        try:
            while True:
                _busy.discard(me)
                try:
                    if spin.cap and reader.end - reader.start < hsize and _may_spin(me):
                        _spinning.add(me)
                        try:
                            reader.fill(hsize, spin, me)
                        finally:
                            _spinning.discard(me)
                    else:
                        reader.fill(hsize)
                except (ConnectionError, OSError):
                    return
                _busy.add(me)
                now = _request_from(me)
                conn.flags = FLAG_SPIN if spin.cap and _sole_client(now) else 0
                version, flags, msg_len, payload_len = unpack_from(reader.buf, reader.start)
                reader.start += hsize
                if version != PROTOCOL_VERSION or msg_len > MAX_MESSAGE or payload_len > MAX_PAYLOAD:
                    conn.oneway = False
                    conn.reply(Err("invalid_argument", f"bad frame: protocol version {version} (this server speaks "
                                   f"{PROTOCOL_VERSION}), message {msg_len} bytes, payload {payload_len} bytes"))
                    return
                if msg_len <= len(reader.buf):
                    reader.fill(msg_len)
                    body = reader.view[reader.start:reader.start + msg_len]
                    reader.start += msg_len
                else:
                    body = bytearray(msg_len)
                    got = reader.take_into(memoryview(body))
                    recv_exact_into(sock, memoryview(body)[got:])
                payload = Payload(sock, payload_len, reader, spin=bool(conn.flags & FLAG_SPIN))
                conn.oneway = bool(flags & FLAG_ONEWAY)
                conn.replied = False
                try:
                    msg = decode(body)
                except msgspec.DecodeError as exc:
                    payload.drain()
                    conn.reply(Err("invalid_argument", f"malformed message: {exc}"))
                    continue
                del body  # a view of the buffer, which the next recv reuses
                self._dispatch(msg, payload, conn)
        except (ConnectionError, OSError) as exc:
            log.debug("%s: connection from %s ended: %s", self.name, peer, exc)
        finally:
            _busy.discard(me)
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
        self.unix: str | None = None  # connect here instead (same host), see `use_unix`
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._header = bytearray(HEADER.size)
        self.payload_left = 0
        self._local: tuple | None = None  # this connection's address, while in `_local_clients`
        self._spin = _Spin(0)  # polls before a blocking wait for a reply (cap 0 to a local server)
        self._hinted = False  # the last reply carried FLAG_SPIN

    def use_unix(self, unix_address: str | None) -> bool:
        """Move this connection to the server's unix socket (same host); False (staying on TCP)
        when there is none here or it cannot be reached. The address stays the TCP one."""
        if not unix_address or not _UNIX:
            return False
        if self.unix == unix_address:
            return True
        sock = self._open_unix(unix_address)
        if sock is None:
            return False
        self.close()
        self.unix = unix_address
        self._setup(sock)
        return True

    def _open_unix(self, unix_address: str) -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(_unix_name(unix_address))
            return sock
        except OSError as exc:
            sock.close()
            log.info("unix socket %s of %s unreachable (%s); using TCP", unix_address, self.address, exc)
            return None

    def _connect(self) -> socket.socket:
        sock = None
        if self.unix is not None:
            sock = self._open_unix(self.unix)
            if sock is None:
                self.unix = None  # the server moved or restarted: TCP from now on
        if sock is None:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
            except OSError as exc:
                raise Unavailable(f"cannot reach {self.address}: {exc.strerror or exc}") from None
        return self._setup(sock)

    def _setup(self, sock: socket.socket) -> socket.socket:
        _tune(sock)
        # Blocking mode with kernel timeouts: a Python-level timeout makes the socket non-blocking,
        # and then MSG_WAITALL returns early and a large reply arrives in many pieces.
        sock.settimeout(None)
        tv = struct.pack("ll", int(self.timeout), int((self.timeout % 1) * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        if sock.family == socket.AF_UNIX:
            self._spin = _Spin(0 if _peer_pid(sock) == os.getpid() else _SPIN_POLLS)
            self._sock = sock
            return sock
        try:
            self._local = tuple(sock.getsockname()[:2])
            _local_clients.add(self._local)
            self._spin = _Spin(0 if _serves_locally(tuple(sock.getpeername()[:2])) else _SPIN_POLLS)
        except OSError:
            self._spin = _Spin(0)
        self._sock = sock
        return sock

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None
                self.payload_left = 0
                self._hinted = False
                if self._local is not None:
                    _local_clients.discard(self._local)
                    self._local = None

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
            header = memoryview(self._header)
            got, spin, hinted = -1, self._spin, self._hinted
            polls = spin.polls if hinted else 0  # spin only when the server said we are its only client
            spun = polls > 0
            while polls:  # a quick reply is read without sleeping (see `_Spin`)
                try:
                    got = sock.recv_into(header, 0, _DONTWAIT)
                    spin.won()
                    break
                except BlockingIOError:
                    polls -= 1
                    _yield()
            if got == 0:
                raise ConnectionError("peer closed the connection")
            if got < 0:
                if hinted and spin.cap and not spun:  # spinning is off for now: time the wait
                    t0 = time.monotonic_ns()
                    recv_exact_into(sock, header)
                    spin.waited(time.monotonic_ns() - t0)
                else:
                    if spun:
                        spin.lost()
                    recv_exact_into(sock, header)
            elif got < len(header):
                recv_exact_into(sock, header[got:])
            version, flags, msg_len, payload_len = HEADER.unpack(self._header)
            self._hinted = bool(flags & FLAG_SPIN)
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
            if self._hinted and n >= _STREAM_SPIN_MIN_CLIENT and self._spin.cap:
                _recv_polling(self._sock, view)
            else:
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
