"""`RpcClient`: one persistent connection to an `RpcServer` (`kvpool.rpc.server`).

Same host: told to (`use_unix`), a client moves its connection to the server's abstract unix
socket (a 64 KiB round trip costs about half of loopback TCP's); it keeps its TCP address as
its identity and falls back to TCP if the unix socket cannot be reached. It spins for a reply
only when the server's last reply said it may (`FLAG_SPIN`, see `kvpool.rpc.spin`).

Given a `Credential` (or a keyring in `settings.security.auth_file`, else the user's own keyring
made on first use: `kvpool.security.local`), a client proves its principal with
`transfer.auth`'s handshake on every connection it opens, TCP or unix, before any frame; a
refused or failed handshake is `Unauthorized`.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import time
from typing import Any, Sequence

import msgspec

from kvpool.security.keyring import Credential, load_keyring
from kvpool.security.local import resolve as resolve_keyring
from kvpool.config import Settings, current_settings
from kvpool.errors import InvalidArgument, LimitExceeded, Unauthorized, Unavailable, error_from_code
from kvpool.messages import PROTOCOL_VERSION, Err
from kvpool.rpc.frame import (FLAG_ONEWAY, FLAG_SPIN, HEADER, MAX_MESSAGE, MAX_PAYLOAD, Payload, parse_address,
                               reply_decoder, send_frame, unix_name)
from kvpool.rpc.server import UNIX_SUPPORTED
from kvpool.rpc.spin import STREAM_POLLS, STREAM_SPIN_MIN_CLIENT, Spin, local
from transfer.auth import AuthError, AuthLimited, NotHandshake, client_handshake
from transfer.framing import DONTWAIT, peer_closed, peer_pid, recv_exact_into, recv_polling, sched_yield, tune

log = logging.getLogger("kvpool.rpc")

BIG_MESSAGE = 1 << 20  # a reply message longer than this is read as it arrives, not allocated up front
READ_AHEAD = 8 << 10  # a connection's receive buffer for a reply's header and message
STALE_CHECK_S = 1.0  # a connection quiet this long is checked for a close by the server before reuse


class RpcClient:
    """One persistent connection to an `RpcServer`. Not thread-safe: one call at a time.

    `call` returns the reply message (an `Err` reply is raised as its typed error); the reply's
    payload, if any, is then read with `read_payload_into` / `read_payload` before the next call
    (or is drained automatically). A broken connection raises `Unavailable` and reconnects on
    the next call. `settings`: its `[rpc]` knobs and `[security]` (default: `current_settings()`). `credential`: who
    to prove to be on each connection (default: `credential_from(settings)`; None there: no
    authentication).
    """

    def __init__(self, address: str, timeout: float = 10.0, settings: Settings | None = None,
                 credential: Credential | None = None):
        settings = settings or current_settings()
        self.credential = credential if credential is not None else credential_from(settings)
        self.address = address
        self.host, self.port = parse_address(address)
        self.unix: str | None = None  # connect here instead (same host), see `use_unix`
        self.timeout = timeout
        self._polls = settings.rpc.rpc_spin
        self._unix_ok = settings.rpc.rpc_unix and UNIX_SUPPORTED
        self._sock: socket.socket | None = None
        # A reply's header and message arrive with one recv into `_buf` (`recv_reply`); bytes past
        # its message (a payload's head) wait in `_buf[_start:_end]` for the payload reads.
        self._buf = bytearray(READ_AHEAD)
        self._view = memoryview(self._buf)
        self._start = self._end = 0
        self._expect: dict[type, int] = {}  # request type -> its last reply's message length, if a payload followed
        self._sent: type = type(None)  # the type of the request in flight
        self.max_reply = settings.rpc.max_reply_bytes or MAX_PAYLOAD  # a reply announcing more is refused
        self._used = 0.0  # when this connection last sent (`_open_sock`)
        self.payload_left = 0
        self._local: tuple | None = None  # this connection's address, while in `local.clients`
        self._spin = Spin(0)  # polls before a blocking wait for a reply (cap 0 to a local server)
        self._hinted = False  # the last reply carried FLAG_SPIN

    def use_unix(self, unix_address: str | None) -> bool:
        """Move this connection to the server's unix socket (same host); False (staying on TCP)
        when there is none here or it cannot be reached. The address stays the TCP one."""
        if not unix_address or not self._unix_ok:
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
            sock.connect(unix_name(unix_address))
        except OSError as exc:
            sock.close()
            log.info("unix socket %s of %s unreachable (%s); using TCP", unix_address, self.address, exc)
            return None
        return self._authenticate(sock)

    def _authenticate(self, sock: socket.socket) -> socket.socket:
        """Prove our credential on a new connection (nothing to do without one)."""
        cred = self.credential
        if cred is None:
            return sock
        try:
            client_handshake(sock, cred.principal, cred.secret, "rpc", timeout=min(self.timeout, 10.0))
        except AuthLimited as exc:  # closed at a connection limit before we authenticated
            sock.close()
            raise LimitExceeded(f"{self.address}: {exc}") from None
        except NotHandshake as exc:  # the server answered with a frame: its refusal, read as one
            try:
                raise self._refusal(sock, exc.first) from None
            finally:
                sock.close()
        except AuthError as exc:
            sock.close()
            raise Unauthorized(f"{self.address}: principal {cred.principal!r}: {exc}{_implicit_hint(cred)}") from None
        return sock

    def _refusal(self, sock: socket.socket, first: bytes) -> Exception:
        """The error an RPC frame sent in place of the handshake's answer says (a server refusing
        the connection at a limit before it read our hello, or one that takes no hello)."""
        try:
            sock.settimeout(min(self.timeout, 2.0))
            rest = sock.recv(HEADER.size - len(first), socket.MSG_WAITALL)
            version, _, msg_len, _ = HEADER.unpack(first + rest)
            if version != PROTOCOL_VERSION or msg_len > 1 << 16:
                raise ValueError(f"protocol {version}, message {msg_len} bytes")
            reply = reply_decoder.decode(sock.recv(msg_len, socket.MSG_WAITALL))
        except (OSError, ValueError, struct.error, msgspec.DecodeError) as exc:
            return Unauthorized(f"{self.address}: the server answered the authentication hello with neither the "
                                f"handshake nor a refusal ({exc})")
        if isinstance(reply, Err):
            return error_from_code(reply.code, f"{self.address}: {reply.message}")
        return Unauthorized(f"{self.address}: the server answered the authentication hello with a "
                            f"{type(reply).__name__}")

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
            sock = self._authenticate(sock)
        return self._setup(sock)

    def _setup(self, sock: socket.socket) -> socket.socket:
        # Blocking, with kernel timeouts: a Python-level timeout makes the socket non-blocking,
        # and then MSG_WAITALL returns early and a large reply arrives in many pieces.
        tune(sock, self.timeout)
        if sock.family == socket.AF_UNIX:
            self._spin = Spin(0 if peer_pid(sock) == os.getpid() else self._polls)
            self._sock = sock
            return sock
        try:
            self._local = tuple(sock.getsockname()[:2])
            local.clients.add(self._local)
            self._spin = Spin(0 if local.serves(tuple(sock.getpeername()[:2])) else self._polls)
        except OSError:
            self._spin = Spin(0)
        self._sock = sock
        return sock

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None
                self.payload_left = 0
                self._start = self._end = 0
                self._hinted = False
                if self._local is not None:
                    local.clients.discard(self._local)
                    self._local = None

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def _broken(self, exc: BaseException) -> Unavailable:
        self.close()
        return Unavailable(f"connection to {self.address} failed: {exc}")

    def _open_sock(self) -> socket.socket:
        """The connection, reopened when it sat idle and the server has closed it meanwhile
        (its idle timeout, a restart): checked only after `STALE_CHECK_S` of quiet, so a busy
        client pays one clock read per call and no syscall."""
        sock = self._sock
        if sock is not None and time.monotonic() - self._used > STALE_CHECK_S and peer_closed(sock):
            log.debug("connection to %s was closed by the server while idle; reconnecting", self.address)
            self.close()
            sock = None
        return sock or self._connect()

    def send_oneway(self, msg: Any) -> None:
        sock = self._open_sock()
        self._used = time.monotonic()
        if self.payload_left:
            self.skip_payload()
        try:
            send_frame(sock, msg, (), FLAG_ONEWAY)
        except OSError as exc:
            raise self._broken(exc) from None

    def call(self, msg: Any, buffers: Sequence[Any] = ()) -> Any:
        self.send_request(msg, buffers)
        return self.recv_reply()

    def send_request(self, msg: Any, buffers: Sequence[Any] = ()) -> None:
        """First half of `call`: lets a caller send to several servers before waiting on any."""
        sock = self._open_sock()
        self._used = time.monotonic()
        if self.payload_left:
            self.skip_payload()
        self._sent = type(msg)
        try:
            send_frame(sock, msg, buffers)
        except OSError as exc:
            raise self._broken(exc) from None

    def recv_reply(self) -> Any:
        """Second half of `call`: the reply to the request sent last. Its header and message come
        with one recv: as much as has arrived when the last reply to this request type had no
        payload, else exactly that reply's header and message (so the payload goes from the socket
        straight where the caller reads it, e.g. a get's `bytes`, not through `_buf`)."""
        sock = self._sock
        if sock is None:
            raise Unavailable(f"connection to {self.address} is closed")
        view, hsize = self._view, HEADER.size
        try:
            end = self._compact() if self._end != self._start else 0
            want = self._expect.get(self._sent, 0)
            limit = hsize + want if want else READ_AHEAD
            if end < hsize:  # (a Python line costs about what a syscall does here: the common path is short)
                k = self._first_recv(sock, end, limit) if self._hinted or end else sock.recv_into(view, limit)
                if not k:
                    raise ConnectionError("peer closed the connection")
                end += k
                while end < hsize:
                    k = sock.recv_into(view[end:limit])
                    if not k:
                        raise ConnectionError("peer closed the connection")
                    end += k
            version, flags, msg_len, payload_len = HEADER.unpack_from(view)
            self._hinted = bool(flags & FLAG_SPIN)
            if version != PROTOCOL_VERSION:
                raise ConnectionError(f"server speaks protocol {version}, this client {PROTOCOL_VERSION}")
            if msg_len > MAX_MESSAGE or payload_len > MAX_PAYLOAD:  # before allocating anything for it
                raise ConnectionError(f"bad reply frame: message {msg_len} bytes, payload {payload_len} bytes")
            if msg_len + payload_len > self.max_reply:
                self.close()  # the stream cannot be kept in frame without reading it all
                raise LimitExceeded(f"reply from {self.address} announces {msg_len} + {payload_len} bytes, over "
                                    f"this client's max_reply_bytes ({self.max_reply}); connection closed")
            msg_end = hsize + msg_len
            if msg_end <= READ_AHEAD:
                if end < msg_end:
                    recv_exact_into(sock, view[end:msg_end])
                    end = msg_end
                body: Any = view[hsize:msg_end]
                self._start, self._end = msg_end, end
                if payload_len:
                    if want != msg_len:
                        self._expect[self._sent] = msg_len
                elif want:
                    self._expect[self._sent] = 0
            else:
                body = self._big_body(sock, msg_len, view[hsize:end])
                self._start = self._end = 0
        except (OSError, ConnectionError) as exc:
            raise self._broken(exc) from None
        self.payload_left = payload_len
        try:
            reply = reply_decoder.decode(body)
        except msgspec.DecodeError as exc:
            raise self._broken(exc) from None
        if isinstance(reply, Err):
            if payload_len:
                self.skip_payload()
            raise error_from_code(reply.code, reply.message)
        return reply

    def _compact(self) -> int:
        """Move the bytes buffered past the last reply (the next one's start) to the front."""
        n = self._end - self._start
        self._buf[:n] = bytes(self._view[self._start:self._end])
        self._start, self._end = 0, n
        return n

    def _first_recv(self, sock: socket.socket, end: int, limit: int) -> int:
        """The first bytes of a reply into `_buf[end:limit]` (0: the server closed): polled for
        when the server said we are its only client (`FLAG_SPIN`), else waited for."""
        into = self._view[end:limit]
        got, spin, hinted = -1, self._spin, self._hinted
        polls = spin.polls if hinted else 0  # spin only when the server said we are its only client
        spun = polls > 0
        while polls:  # a quick reply is read without sleeping
            try:
                got = sock.recv_into(into, 0, DONTWAIT)
                spin.won()
                break
            except BlockingIOError:
                polls -= 1
                sched_yield()
        if got < 0:
            if hinted and spin.cap and not spun:  # spinning is off for now: time the wait
                t0 = time.monotonic_ns()
                got = sock.recv_into(into)
                spin.waited(time.monotonic_ns() - t0)
            else:
                if spun:
                    spin.lost()
                got = sock.recv_into(into)
        return got

    @staticmethod
    def _big_body(sock: socket.socket, msg_len: int, head: memoryview) -> bytearray:
        """A message longer than `_buf` whose first bytes are `head`."""
        if msg_len <= BIG_MESSAGE:
            body = bytearray(msg_len)
            body[:len(head)] = head
            recv_exact_into(sock, memoryview(body)[len(head):])
            return body
        body = bytearray(head)  # grown as its bytes arrive: a lying header alone allocates nothing
        while len(body) < msg_len:
            part = sock.recv(min(msg_len - len(body), BIG_MESSAGE))
            if not part:
                raise ConnectionError("peer closed the connection mid-reply")
            body += part
        return body

    def _take(self, view: memoryview) -> int:
        """Copy what `_buf` holds of the payload into `view`; how many bytes."""
        k = min(self._end - self._start, len(view))
        if k:
            view[:k] = self._view[self._start:self._start + k]
            self._start += k
        return k

    def read_payload_into(self, view: memoryview) -> None:
        n = len(view)
        if n > self.payload_left:
            raise InvalidArgument(f"reply payload has {self.payload_left} bytes left, asked for {n}")
        try:
            if self._end != self._start:  # its head came with the message
                k = self._take(view)
                if k < n:
                    recv_exact_into(self._sock, view[k:])
            elif self._hinted and n >= STREAM_SPIN_MIN_CLIENT and self._spin.cap:
                recv_polling(self._sock, view, STREAM_POLLS)
            else:
                recv_exact_into(self._sock, view)
        except (OSError, ConnectionError) as exc:
            raise self._broken(exc) from None
        self.payload_left -= n

    def read_payload(self, n: int) -> bytes:
        """The next n payload bytes as one `bytes` (one allocation, no extra copy, unless the
        payload's head came with the message: `recv_reply`)."""
        if n > self.payload_left:
            raise InvalidArgument(f"reply payload has {self.payload_left} bytes left, asked for {n}")
        try:
            k = min(self._end - self._start, n) if self._end != self._start else 0
            if k:
                head = bytes(self._view[self._start:self._start + k])
                self._start += k
                data = head + self._recv_bytes(n - k) if k < n else head
            else:
                data = self._recv_bytes(n)
        except (OSError, ConnectionError) as exc:
            raise self._broken(exc) from None
        self.payload_left -= n
        return data

    def _recv_bytes(self, n: int) -> bytes:
        data = self._sock.recv(n, socket.MSG_WAITALL)
        if len(data) != n:  # interrupted or timed out part-way: finish into one buffer
            if not data:
                raise ConnectionError("peer closed the connection")
            buf = bytearray(n)
            buf[: len(data)] = data
            recv_exact_into(self._sock, memoryview(buf)[len(data):])
            data = bytes(buf)
        return data

    def skip_payload(self, n: int | None = None) -> None:
        """Discard the next n payload bytes (all that is left by default)."""
        n = self.payload_left if n is None else min(n, self.payload_left)
        try:
            k = min(self._end - self._start, n)
            self._start += k
            if n > k:
                Payload(self._sock, n - k).drain()
        except (OSError, ConnectionError) as exc:
            raise self._broken(exc) from None
        self.payload_left -= n


def credential_from(settings: Settings) -> Credential | None:
    """The credential `settings.security` names (`auth_file` + `principal`), else the user's own
    keyring's (`kvpool.security.local`), or None: authentication off."""
    security = settings.security
    if security.auth_file:
        return load_keyring(security.auth_file).credential(security.principal)
    keyring = resolve_keyring(None)  # KVPOOL_AUTH_FILE, else the per-user keyring
    if keyring is None:
        return None
    return LocalCredential.of(keyring) if keyring.local else keyring.credential(security.principal)


def node_credential(settings: Settings) -> Credential | None:
    """What masters and nodes present to each other: the keyring's node principal (None: off)."""
    keyring = resolve_keyring(settings.security.auth_file)
    return keyring.node_credential() if keyring is not None else None


class LocalCredential(Credential):
    """The per-user keyring's credential, used because nothing was configured: its refusals say so."""

    @classmethod
    def of(cls, keyring) -> "LocalCredential":
        cred = keyring.node_credential()
        return cls(cred.principal, cred.secret)


def _implicit_hint(cred: Credential | None) -> str:
    if not isinstance(cred, LocalCredential):
        return ""
    from kvpool.security.local import LOCAL_ENV, local_dir

    return (f" (this client proved its user's own keyring, {local_dir() / 'keyring.toml'}, as nothing else was "
            f"configured: a pool of another user or host needs KVPOOL_AUTH_FILE with a principal of its keyring; "
            f"one running with {LOCAL_ENV}=off needs the same setting here; see docs/security.md)")
