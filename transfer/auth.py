"""Connection authentication: a mutual HMAC-SHA256 challenge over a per-principal shared secret.

Used by every port that accepts bytes (the pool RPC, the master RPC, the transfer data server).
It runs once, right after connect, before the port's own protocol; the connection then belongs
to the principal it proved, and the port's handlers authorize each request against it.

Wire (all lengths in bytes, big-endian):

    C -> S  HELLO  magic "KVA1" | principal length (1) | principal (UTF-8) | client nonce (32)
    S -> C  CHALL  status (1) | server nonce (32) | server proof (32)
    C -> S  PROOF  client proof (32)
    S -> C  DONE   status (1) | reason length (1) | reason (UTF-8, only when refused)

    or, in place of CHALL or DONE, when the server closes a connection still authenticating at one
    of its limits (`transfer.listener`: too many unauthenticated connections, the handshake deadline):
    S -> C  LIMIT  LIMITED (1) | reason length (1) | reason (UTF-8)

    server proof = HMAC(secret, "kvpool-auth/v1 server" | channel | principal | cnonce | snonce)
    client proof = HMAC(secret, "kvpool-auth/v1 client" | channel | principal | cnonce | snonce)

Both sides prove the secret, so a client also knows it reached the real server (a server
without the secret cannot make the server proof). Fresh nonces on both sides make a recorded
exchange useless on another connection; the distinct labels stop a proof being reflected.
`channel` names the port kind ("rpc", "transfer"), so a proof for one is not one for the other.
An unknown principal gets a CHALL with a random proof (the same bytes and timing as a known
one), and then the same refusal as a wrong secret: the port is no oracle of principal names.

What this does not do: it authenticates the connection's start, not each frame, and encrypts
nothing. On a network where someone can take over an established TCP connection, run the pool
inside a private network or a tunnel (docs/security.md says so).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import socket
import time
from typing import Callable

MAGIC = b"KVA1"
NONCE = 32
PROOF = 32
OK, REFUSED, NOT_CONFIGURED, LIMITED = 0, 1, 2, 3
MAX_PRINCIPAL = 255
HANDSHAKE_TIMEOUT = 5.0  # default seconds a peer has for the whole exchange (servers pass their own deadline)

SecretLookup = Callable[[str], "bytes | None"]


class AuthError(Exception):
    """The handshake failed; the message says why (never which secret or principal exists)."""


class AuthLimited(AuthError):
    """The server closed the connection before it authenticated, at one of its limits (too many
    unauthenticated connections, the handshake deadline); the message is the server's reason."""


class NotHandshake(AuthError):
    """The server answered the hello with something that is not the handshake (`first`: the byte
    read): its protocol's own refusal frame, which the caller reads with the protocol's framing."""

    def __init__(self, first: bytes):
        super().__init__(f"the server did not answer the authentication hello (first byte {first!r})")
        self.first = first


def _proof(secret: bytes, label: bytes, channel: str, principal: str, cnonce: bytes, snonce: bytes) -> bytes:
    msg = b"kvpool-auth/v1 " + label + b"\0" + channel.encode() + b"\0" + principal.encode() + b"\0" + cnonce + snonce
    return hmac.new(secret, msg, hashlib.sha256).digest()


def _recv(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise AuthError("peer closed the connection during authentication")
        buf += part
    return bytes(buf)


def looks_like_hello(first: bytes) -> bool:
    """Whether the first bytes a server read open a HELLO (so it must run `serve_handshake`)."""
    return first[:len(MAGIC)] == MAGIC


def client_handshake(sock: socket.socket, principal: str, secret: bytes, channel: str,
                     timeout: float = HANDSHAKE_TIMEOUT) -> None:
    """Prove `principal` to the server on `sock` and check the server's proof. Raises `AuthError`
    (the connection is then unusable: close it). Restores the socket's previous timeout."""
    name = principal.encode()
    if not 0 < len(name) <= MAX_PRINCIPAL:
        raise AuthError(f"principal name must be 1..{MAX_PRINCIPAL} bytes of UTF-8")
    old = sock.gettimeout()
    sock.settimeout(timeout)
    try:
        cnonce = os.urandom(NONCE)
        sock.sendall(MAGIC + bytes([len(name)]) + name + cnonce)
        first = _recv(sock, 1)
        status = first[0]
        if status == LIMITED:
            raise AuthLimited(_reason(sock, _recv(sock, 1)[0], "the server is at a connection limit"))
        if status not in (OK, NOT_CONFIGURED):
            raise NotHandshake(first)
        chall = _recv(sock, NONCE + PROOF)
        snonce, sproof = chall[:NONCE], chall[NONCE:]
        if status == NOT_CONFIGURED:
            raise AuthError("the server has no authentication configured, so it cannot prove who it is; "
                            "configure the same keyring on it (KVPOOL_AUTH_FILE) or connect without a credential")
        if not hmac.compare_digest(sproof, _proof(secret, b"server", channel, principal, cnonce, snonce)):
            # Still answer, so the server logs the failure; then refuse the server.
            sock.sendall(bytes(PROOF))
            raise AuthError("the server's proof is wrong: it does not hold this principal's secret "
                            "(wrong server, or the keyrings differ)")
        sock.sendall(_proof(secret, b"client", channel, principal, cnonce, snonce))
        done = _recv(sock, 2)
        if done[0] == LIMITED:
            raise AuthLimited(_reason(sock, done[1], "at a limit"))
        if done[0] != OK:
            raise AuthError(f"authentication refused: {_reason(sock, done[1], 'refused')}")
    except OSError as exc:  # TimeoutError included
        raise AuthError(f"authentication failed: {exc}") from None
    finally:
        with contextlib.suppress(OSError):
            sock.settimeout(old)


def _reason(sock: socket.socket, n: int, default: str) -> str:
    """The `n` bytes of UTF-8 reason that follow a refusing status and its length byte (`default`: none)."""
    return _recv(sock, n).decode("utf-8", "replace") if n else default


def send_limited(sock: socket.socket, reason: str) -> None:
    """Tell a client still authenticating that the server closes its connection at a limit (in
    place of CHALL or DONE, whichever it waits for: both start status | reason length)."""
    body = reason.encode()[:255]
    with contextlib.suppress(OSError):
        sock.sendall(bytes([LIMITED, len(body)]) + body)


def serve_handshake(sock: socket.socket, first: bytes, lookup: SecretLookup | None, channel: str,
                    timeout: float = HANDSHAKE_TIMEOUT, evicted: Callable[[], str | None] | None = None) -> str:
    """Run the server side, `first` being the bytes already read (at least the magic). Returns the
    principal proved. Raises `AuthError` after telling the client (the caller closes).
    `lookup`: principal -> secret (None: unknown); None when this server has no keyring.
    `timeout`: seconds for the whole exchange (a deadline, not per read). `evicted`: the reason the
    server closed this connection meanwhile at a limit (it shut its read side), or None; the client
    is then told that reason (LIMITED) instead of a bare close."""
    old = sock.gettimeout()
    deadline = time.monotonic() + timeout
    sock.settimeout(timeout)
    try:
        return _serve(sock, first, lookup, channel, deadline)
    except AuthError:
        why = evicted() if evicted is not None else None
        if why is not None:
            send_limited(sock, why)
            raise AuthLimited(why) from None
        raise
    finally:
        with contextlib.suppress(OSError):
            sock.settimeout(old)


def _serve(sock: socket.socket, first: bytes, lookup: SecretLookup | None, channel: str, deadline: float) -> str:
    def recv(n: int) -> bytes:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AuthError("authentication failed: the handshake deadline passed")
        sock.settimeout(left)
        return _recv(sock, n)

    try:
        head = first + recv(max(0, len(MAGIC) + 1 - len(first)))
        if head[:len(MAGIC)] != MAGIC:
            raise AuthError("not an authentication hello")
        plen = head[len(MAGIC)]
        rest = head[len(MAGIC) + 1:]
        rest += recv(plen + NONCE - len(rest))
        name, cnonce = rest[:plen], rest[plen:plen + NONCE]
        try:
            principal = name.decode()
        except UnicodeDecodeError:
            principal = ""
        if lookup is None:
            sock.sendall(bytes([NOT_CONFIGURED]) + bytes(NONCE + PROOF))
            raise AuthError("a client offered authentication but this server has none configured")
        secret = lookup(principal) if principal else None
        snonce = os.urandom(NONCE)
        key = secret if secret is not None else os.urandom(32)  # unknown: same shape, unverifiable
        sock.sendall(bytes([OK]) + snonce + _proof(key, b"server", channel, principal, cnonce, snonce))
        cproof = recv(PROOF)
        good = hmac.compare_digest(cproof, _proof(key, b"client", channel, principal, cnonce, snonce))
        if secret is None or not good:
            reason = b"unknown principal or wrong secret"
            sock.sendall(bytes([REFUSED, len(reason)]) + reason)
            raise AuthError(f"refused principal {principal!r}: unknown principal or wrong secret")
        sock.sendall(bytes([OK, 0]))
        return principal
    except OSError as exc:  # TimeoutError included
        raise AuthError(f"authentication failed: {exc}") from None


def peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end of a unix socket (SO_PEERCRED), None elsewhere."""
    if sock.family != getattr(socket, "AF_UNIX", None) or not hasattr(socket, "SO_PEERCRED"):
        return None
    import struct
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]
