"""`RpcServer`: serves the pool's RPC (`kvpool.rpc.frame`) over TCP and, on Linux, an abstract
unix socket for same-host clients (`unix_address`, "@kvpool-rpc-<port>-<random>", no file to
clean up), which the node and master advertise (hello, node info).

One thread per connection (blocking sockets: on loopback this beats an event loop by tens of
microseconds per call). A handler gets `(msg, payload, conn)` and returns a reply message, a
`(reply, buffers)` pair, or None when it already called `conn.reply` itself (to send while
holding a pin). A `KVPoolError` becomes an `Err` reply; any other exception is logged and
becomes an `internal` error; either way the connection and the server keep serving.

Invariants: at most one request is outstanding on a connection; a one-way frame
(`FLAG_ONEWAY`) gets no reply; a frame with a wrong version or an undecodable message gets an
`Err` and the connection is closed. The server owns its `SpinPolicy` (`kvpool.rpc.spin`).

Identity: with a keyring (`keyring=`, else `settings.security.auth_file`'s, else the user's own made
on first use, `kvpool.security.local`; none only with `KVPOOL_LOCAL_AUTH=off`), each new connection must open
with `transfer.auth`'s handshake (channel "rpc"); its proved principal is `ServerConn.principal`,
and `_dispatch` authorizes every request against it and scopes a tenant's keys
(`kvpool.security.authz`). A connection that does not open with a hello gets one `Err("unauthorized")`
saying how to configure a credential, and is closed. The unix socket also takes only peers of
this process's uid or root (`SO_PEERCRED`), keyring or not: an abstract socket has no file
permissions. Without a keyring every connection is `kvpool.security.keyring.ANYONE`. Keys are validated once:
a tenant's here (`authz`), anyone else's per item where they enter the node or the master.

Limits (`settings.rpc`: header and idle timeouts, minimum body rate, connection caps; see
`transfer.framing.Limits` and `transfer.listener`): with a keyring, connections that have not
authenticated yet have a budget of their own (a new one over it replaces the oldest, and each has
`handshake_timeout_s`), so no flood of them locks out a client with a credential; authenticated
ones are capped per server and per principal (the node principal: per server only). A connection
cut or refused at a cap is told why (`Err("limit_exceeded")`, or the handshake's LIMITED answer
while it authenticates) and closed; a header that stalls, a body slower than the minimum rate, or an idle connection is
closed. A message is grown as its bytes arrive and a payload goes straight where it belongs, so
an announced length allocates nothing. Each socket's kernel timeout is set once at accept.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import sys
import threading
import time
from typing import Any, Callable, Sequence

import msgspec

from kvpool.security.keyring import ANYONE, Keyring, Principal
from kvpool.security.local import resolve as resolve_keyring
from kvpool.config import Settings, current_settings
from kvpool.errors import Forbidden, InvalidArgument, KVPoolError, LimitExceeded, Unavailable
from kvpool.messages import PROTOCOL_VERSION, Err
from kvpool.rpc.frame import (FLAG_ONEWAY, FLAG_SPIN, HEADER, MAX_MESSAGE, MAX_PAYLOAD, Payload, Reader, encoder,
                              payload_nbytes, request_decoder, send_frame, unix_name)
from kvpool.security.authz import NODE_ONLY, ROLE_NAMES, RULES, rank, scope_of
from kvpool.rpc.loop import Inline, Link, LoopServing, ServeLoop
from kvpool.rpc.spin import CpuPressure, SpinPolicy, local
from transfer.auth import MAGIC, AuthError, AuthLimited, looks_like_hello, peer_uid, serve_handshake
from transfer.framing import Stalled, peer_pid, refuse_after
from transfer.listener import Listener

log = logging.getLogger("kvpool.rpc")

UNIX_SUPPORTED = sys.platform.startswith("linux") and hasattr(socket, "AF_UNIX")
HOW_TO_AUTH = ("this pool requires authentication: give the client a credential (set KVPOOL_AUTH_FILE to a "
               "keyring file holding your principal and its secret, and KVPOOL_PRINCIPAL to its name; "
               "see docs/security.md)")


class ServerConn:
    """One accepted connection, as a handler sees it."""

    def __init__(self, sock: socket.socket, peer: str, principal: Principal = ANYONE):
        self.sock = sock
        self.peer = peer
        self.principal = principal  # who proved themselves on this connection (`kvpool.security.keyring`)
        self.rank = rank(principal)  # its role's rank (`kvpool.security.authz`), once per connection
        self.scope = scope_of(principal)  # the prefix of its keys as stored ("": unscoped)
        self.replied = False
        self.oneway = False
        self.flags = 0  # reply flags for the request being handled (FLAG_SPIN)
        self.state: dict[str, Any] = {}  # per-connection handler state (e.g. pins to drop on close)
        self.link: Link | None = None  # while served by the server's loop (`kvpool.rpc.loop`)

    def reply(self, msg: Any, buffers: Sequence[Any] = (), release: Callable[[], None] | None = None) -> None:
        """Send the reply to the request being handled. `release`: called once the bytes of
        `buffers` are no longer needed (sent, or the connection ended): a handler sending from
        pinned memory passes its unpin here, which lets the loop send without blocking."""
        if self.oneway:
            if release is not None:
                release()
            return
        self.replied = True
        link = self.link
        if link is not None:  # the loop: never block (what the kernel does not take now follows)
            body = encoder.encode(msg)
            n = payload_nbytes(buffers)
            head = HEADER.pack(PROTOCOL_VERSION, self.flags, len(body), n) + body
            link.loop.send(link, [head, *buffers], len(head) + n, release)
            return
        try:
            send_frame(self.sock, msg, buffers, self.flags)  # one send; a payload from where it lies
        finally:
            if release is not None:
                release()


Handler = Callable[[Any, Payload, ServerConn], Any]


class RpcServer(LoopServing):
    """Serve `handlers` (message type -> handler) on host:port (0: a free port).

    `handlers` may be filled in after construction, before `start` (the embedded pool's node
    and master share one server), and so may `inline`: the message types whose handlers never
    block (`Inline`); with any, and `settings.rpc.rpc_loop`, connections are served by one loop
    thread (`kvpool.rpc.loop`), else each by its own thread. `settings`: its `[rpc]` knobs and
    `[security]` (default: `current_settings()`). `keyring`: authenticate every connection against
    it (default: `settings.security.auth_file`'s, else the user's own, or none: authentication off).
    `reuse_port`: share host:port with other servers of this uid (SO_REUSEPORT: the kernel spreads
    new connections over them; a node's read workers, `kvpool.node.readers`)."""

    def __init__(self, handlers: dict[type, Handler], host: str = "127.0.0.1", port: int = 0, name: str = "rpc",
                 on_close: Callable[[ServerConn], None] | None = None, unix: bool = True,
                 settings: Settings | None = None, keyring: Keyring | None = None,
                 inline: dict[type, Inline] | None = None, reuse_port: bool = False):
        settings = settings or current_settings()
        # the configured keyring, else this user's own (`kvpool.security.local`; None when turned off)
        self.keyring = keyring if keyring is not None else resolve_keyring(settings.security.auth_file)
        self.handlers = handlers
        self.inline: dict[type, Inline] = dict(inline or {})
        self._use_loop = settings.rpc.rpc_loop
        self._loop: ServeLoop | None = None
        self.name = name
        self.on_close = on_close
        self.spin = SpinPolicy(settings.rpc.server_spin, CpuPressure(settings.rpc.spin_max_cpu_pressure))
        try:
            self._sock = socket.create_server((host, port), backlog=1024, reuse_port=reuse_port)
        except OSError as exc:
            raise Unavailable(f"{name}: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        # Listening on every interface: advertise this machine's address, not 0.0.0.0.
        self.host = host if host not in ("0.0.0.0", "::", "") else socket.gethostbyname(socket.gethostname())
        self.port = self._sock.getsockname()[1]
        self._listen_addr = tuple(self._sock.getsockname()[:2])
        local.servers.add(self._listen_addr)
        self.unix_address: str | None = None
        self._unix_sock: socket.socket | None = None
        if unix and settings.rpc.rpc_unix and UNIX_SUPPORTED:
            uname = f"@kvpool-rpc-{self.port}-{secrets.token_hex(6)}"
            try:
                usock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                usock.bind(unix_name(uname))
                usock.listen(1024)
            except OSError as exc:  # optional: same-host clients use TCP then
                log.info("%s: no unix socket (%s); same-host clients use TCP", name, exc)
            else:
                self._unix_sock, self.unix_address = usock, uname
        # Limits (`RpcSection.limits`): connection caps here, the receive tick set once per socket.
        self.limits = settings.rpc.limits()
        self._idle_ticks = self.limits.idle_ticks()
        self._listener = Listener([self._sock, self._unix_sock], self._serve, name, limits=self.limits,
                                  refusal=self._limit_frame, handshake=self.keyring is not None)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> "RpcServer":
        if self._use_loop and self.inline and UNIX_SUPPORTED:  # epoll: Linux
            self._loop = ServeLoop(self.name, self._frames, self.limits, self.spin)
            self._loop.start()
        self._listener.start()
        return self

    def stop(self) -> None:
        local.servers.discard(self._listen_addr)
        self._listener.close()  # shuts every connection down: the loop sees each end
        if self._loop is not None:
            self._loop.close()

    def _authenticate(self, sock: socket.socket, peer: str) -> Principal | None:
        """The principal of a new connection, or None when it was refused (and told why)."""
        if sock.family == socket.AF_UNIX:
            uid = peer_uid(sock)
            if uid is not None and uid not in (os.getuid(), 0):
                log.warning("%s: refused %s: uid %d is neither this process's (%d) nor root", self.name, peer, uid,
                            os.getuid())
                self._refuse(sock, f"the unix socket serves only uid {os.getuid()} (and root); connect over TCP")
                return None
        keyring = self.keyring
        if keyring is None:
            return self._unauthenticated(sock, peer)
        listener = self._listener
        old = sock.gettimeout()
        sock.settimeout(listener.handshake_deadline(sock) or 0.001)
        try:
            first = sock.recv(len(MAGIC), socket.MSG_WAITALL)
        except OSError:
            first = b""
        finally:
            sock.settimeout(old)
        if not looks_like_hello(first):
            why = listener.eviction(sock)
            if why is not None:  # cut at a limit before it spoke: its protocol's refusal
                refuse_after(sock, self._limit_frame(why))
            elif first:
                log.warning("%s: refused %s: no authentication hello", self.name, peer)
                self._refuse(sock, HOW_TO_AUTH)
            return None
        try:
            name = serve_handshake(sock, first, keyring.secret, "rpc", timeout=listener.handshake_deadline(sock),
                                   evicted=lambda: listener.eviction(sock))
        except AuthLimited as exc:
            log.info("%s: closed %s while it authenticated: %s", self.name, peer, exc)
            return None
        except AuthError as exc:
            log.warning("%s: refused %s: %s", self.name, peer, exc)
            return None
        principal = keyring.principal(name)
        # the pool's own principal (masters, nodes) is trusted infrastructure: not capped per principal
        why = listener.authenticated(sock, None if principal.role == "node" else name)
        if why is not None:
            refuse_after(sock, self._limit_frame(why))
            return None
        return principal

    def _unauthenticated(self, sock: socket.socket, peer: str) -> Principal | None:
        """Without a keyring every connection is `ANYONE`; a client that opens with a handshake
        hello (it holds a credential) is told this server has none, rather than having its hello
        taken for a frame. A peek at the first byte, once per connection."""
        try:
            first = sock.recv(1, socket.MSG_PEEK)
        except OSError:  # silent for a whole tick: the serve loop's idle handling takes over
            return ANYONE
        if first and first[:1] == MAGIC[:1]:
            first = sock.recv(len(MAGIC), socket.MSG_WAITALL)
            if looks_like_hello(first):
                try:
                    serve_handshake(sock, first, None, "rpc", timeout=self._listener.handshake_deadline(sock))
                except AuthError as exc:
                    log.warning("%s: refused %s: %s", self.name, peer, exc)
                return None
            self._refuse(sock, f"bad frame: {first!r} is neither a frame of protocol {PROTOCOL_VERSION} nor a hello")
            return None
        return ANYONE

    @staticmethod
    def _refuse(sock: socket.socket, why: str) -> None:
        body = encoder.encode(Err("unauthorized", why))
        try:
            sock.settimeout(0.5)  # bounds the drain of what the peer already sent
        except OSError:
            return
        refuse_after(sock, HEADER.pack(PROTOCOL_VERSION, 0, len(body), 0) + body)

    @staticmethod
    def _limit_frame(why: str) -> bytes:
        body = encoder.encode(Err(LimitExceeded.code, why))
        return HEADER.pack(PROTOCOL_VERSION, 0, len(body), 0) + body

    def _quiet_tick(self, reader: Reader, peer: str, ticks: list[int]) -> bool:
        """A receive tick passed with no byte while waiting for a header: whether to keep the
        connection (`ticks` = [idle ticks, ticks since a header started])."""
        if reader.end > reader.start:  # a header started and stalled
            ticks[1] += 1
            if ticks[1] >= 2:
                log.info("%s: closing %s: frame header not finished within the header timeout (%.3gs)",
                         self.name, peer, self.limits.header_timeout_s)
                return False
            return True
        ticks[0] += 1
        if self._idle_ticks and ticks[0] >= self._idle_ticks:
            log.debug("%s: closing %s: idle for %.3gs", self.name, peer, self.limits.idle_timeout_s)
            return False
        return True

    def _recv_message(self, sock: socket.socket, reader: Reader, msg_len: int) -> bytearray:
        """A message longer than the read-ahead buffer, grown as its bytes arrive (an announced
        length alone allocates nothing), at the minimum body rate (`transfer.framing.Limits`)."""
        body = bytearray(reader.view[reader.start:reader.end])
        reader.start = reader.end
        rate, grace = self.limits.min_body_rate, self.limits.header_timeout_s
        t0 = time.monotonic()
        while len(body) < msg_len:
            part = sock.recv(min(msg_len - len(body), 1 << 20))  # a silent tick raises BlockingIOError
            if not part:
                raise ConnectionError("peer closed the connection mid-message")
            body += part
            late = time.monotonic() - t0 - grace
            if rate and late > 0 and len(body) < rate * late:
                raise Stalled(f"message body arrives slower than min_body_rate ({len(body)} of {msg_len} bytes)")
        return body

    def _serve(self, sock: socket.socket, addr: Any) -> None:
        if sock.family == socket.AF_UNIX:
            pid = peer_pid(sock)
            peer, in_process = f"unix:pid {pid}", pid == os.getpid()
        else:
            peer, in_process = f"{addr[0]}:{addr[1]}", tuple(addr[:2]) in local.clients
        principal = self._authenticate(sock, peer)
        if principal is None:
            return
        conn = ServerConn(sock, peer, principal)
        reader = Reader(sock)
        try:
            if self._loop is not None:
                self._serve_looped(conn, reader, in_process)
            else:
                self._serve_threaded(conn, reader, in_process)
        except Stalled as exc:
            log.info("%s: cut the connection from %s: %s", self.name, peer, exc)
        except BlockingIOError:
            log.info("%s: cut the connection from %s: a receive or send tick (%.3gs) passed without progress "
                     "mid-frame", self.name, peer, self.limits.header_timeout_s)
        except (ConnectionError, OSError) as exc:
            log.debug("%s: connection from %s ended: %s", self.name, peer, exc)
        finally:
            if self.on_close is not None:
                try:
                    self.on_close(conn)
                except Exception:
                    log.exception("%s: on_close failed", self.name)

    def _one(self, conn: ServerConn, reader: Reader, flags: int, spin: bool, pace: int, msg: Any = None) -> bool:
        """Serve the request whose header is buffered in `reader`, blocking as it needs; False
        when the connection must close (a frame that cannot be trusted). `flags`: the reply's.
        `msg`: the request's message, when the loop already decoded it (its frame is checked
        and its message buffered: only its payload is left to read)."""
        sock = conn.sock
        hsize = HEADER.size
        reader.fill(hsize)
        conn.flags = flags
        version, flags, msg_len, payload_len = HEADER.unpack_from(reader.buf, reader.start)
        reader.start += hsize
        if msg is not None:
            reader.start += msg_len
            conn.oneway = bool(flags & FLAG_ONEWAY)
            conn.replied = False
            self._dispatch(msg, Payload(sock, payload_len, reader, spin=spin, pace=pace), conn)
            return True
        if version != PROTOCOL_VERSION or msg_len > MAX_MESSAGE or payload_len > MAX_PAYLOAD:
            conn.oneway = False
            conn.reply(Err("invalid_argument", f"bad frame: protocol version {version} (this server speaks "
                           f"{PROTOCOL_VERSION}), message {msg_len} bytes, payload {payload_len} bytes"))
            return False
        if msg_len <= len(reader.buf):
            reader.fill(msg_len)
            body = reader.view[reader.start:reader.start + msg_len]
            reader.start += msg_len
        else:
            body = self._recv_message(sock, reader, msg_len)
        payload = Payload(sock, payload_len, reader, spin=spin, pace=pace)
        conn.oneway = bool(flags & FLAG_ONEWAY)
        conn.replied = False
        try:
            msg = request_decoder.decode(body)
        except msgspec.DecodeError as exc:
            payload.drain()
            conn.reply(Err("invalid_argument", f"malformed message: {exc}"))
            return True
        del body  # a view of the buffer, which the next recv reuses
        self._dispatch(msg, payload, conn)
        return True

    def _serve_threaded(self, conn: ServerConn, reader: Reader, in_process: bool) -> None:
        """A thread per connection: wait for each request (polling first when the spin policy
        allows, `kvpool.rpc.spin`), then serve it (`_one`)."""
        peer = conn.peer
        policy = self.spin
        spin = policy.connection(in_process)  # a client in this process needs our GIL: never spin for it
        busy, spinning = policy.busy, policy.spinning
        hsize = HEADER.size
        me = threading.get_ident()
        ticks = [0, 0]  # receive ticks with no byte: while idle, since a header started
        pace = self.limits.min_per_tick
        try:
            while True:
                busy.discard(me)
                try:
                    if spin.cap and reader.end - reader.start < hsize and policy.may_spin(me):
                        spinning.add(me)
                        try:
                            reader.fill(hsize, spin, policy, me)
                        finally:
                            spinning.discard(me)
                    else:
                        reader.fill(hsize)
                except BlockingIOError:  # a receive tick passed without a byte
                    if self._quiet_tick(reader, peer, ticks):
                        continue
                    return
                except (ConnectionError, OSError):
                    return
                ticks[0] = ticks[1] = 0
                busy.add(me)
                now = policy.request_from(me)
                flags = FLAG_SPIN if spin.cap and policy.sole_client(now) else 0
                if not self._one(conn, reader, flags, bool(flags), pace):
                    return
        finally:
            busy.discard(me)

    def _dispatch(self, msg: Any, payload: Payload, conn: ServerConn) -> None:
        handler = self.handlers.get(type(msg))
        try:
            if handler is None:
                raise InvalidArgument(f"{self.name} does not serve {type(msg).__name__}")
            if conn.principal is not ANYONE:  # inline, not a call: it runs on every request with a keyring
                least, scoper = RULES.get(type(msg), NODE_ONLY)
                if conn.rank < least:
                    raise Forbidden(f"{conn.principal} may not send {type(msg).__name__} (it takes "
                                    f"{ROLE_NAMES[least]} principal)")
                if scoper is not None and conn.scope:
                    scoper(msg, conn.scope)  # a tenant's keys, validated and scoped
            out = handler(msg, payload, conn)
        except KVPoolError as exc:
            out = Err(exc.code, str(exc))
        except (ConnectionError, OSError):
            raise
        except Exception as exc:  # a bug in one handler must not take the server down
            log.exception("%s: %s failed", self.name, type(msg).__name__)
            out = Err("internal", f"{type(exc).__name__}: {exc}")
        if payload.remaining:
            try:
                payload.drain()
            except BaseException:
                if isinstance(out, tuple) and len(out) > 2:
                    out[2]()  # the reply's release (an unpin) runs even when it is never sent
                raise
        if conn.replied or out is None:
            return
        if conn.scope and isinstance(out, Err):  # a tenant sees its keys as it named them
            out = Err(out.code, out.message.replace(conn.scope, "").replace(repr(conn.scope)[1:-1], ""))
        if isinstance(out, tuple):  # (reply, buffers) or (reply, buffers, release)
            conn.reply(*out)
        else:
            conn.reply(out)

