"""`Listener`: accepts connections, gives each a thread, and keeps the connection caps
(`transfer.framing.Limits`) so that nobody without a credential can lock out those with one.

A server that authenticates every connection (`handshake=True`: the pool RPC and the transfer
data server with a keyring) keeps two budgets:

- **Unauthenticated**: a connection is *pending* from its accept until the protocol reports it
  authenticated (`authenticated`). At most `max_unauthenticated` are pending per server and
  `max_unauthenticated_per_peer` per peer address; a new connection over either cap takes the
  place of the oldest pending one (its peer's own oldest first), which is told why in its
  protocol's words and closed. A pending connection has `handshake_timeout_s` from its accept.
  So idle or slow unauthenticated sockets, however many and from however many addresses, hold at
  most the pending budget for at most the handshake deadline, and a client that authenticates at
  once (a round trip or two) is pushed out only if a whole budget of newer connections arrives
  within its handshake. Refusing the newcomer instead would let a reconnecting flood keep
  everyone out.
- **Authenticated**: `authenticated(sock, key)` moves a connection out of pending. At most
  `max_connections` per server and `max_connections_per_principal` per principal `key` (None: not
  capped per principal, e.g. the pool's own node principal); over either it is refused.

A server without authentication counts every connection at accept: `max_connections` per server
and `max_connections_per_peer` per peer address; a new connection over either is refused.

Invariants: every accepted socket is in exactly one of pending, established (counted) or refused
(being answered), and leaves the counts when its thread ends; an evicted pending socket leaves
pending at once (its thread then answers and closes it), so the counts never include it.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Sequence

from transfer.framing import NO_LIMITS, Limits, set_io_timeout, shutdown, tune

log = logging.getLogger("transfer.framing")

MAX_REFUSING = 16  # refusals being answered at once; beyond, a refused connection is just closed
UNAUTHENTICATED = "connection limit for unauthenticated peers reached"


class Listener:
    """Accepts connections on `sockets` (listening) and serves each on a thread of its own:
    `serve(sock, peer)`, then the socket is closed. `close` stops accepting and wakes every
    connection's thread (its socket sees EOF); a thread's `serve` must return on that.

    `limits`: connection caps (see the module doc); a connection refused at accept is handed to
    `refuse(sock, message)` (the protocol's own error frame) on a short-lived thread, then closed.
    `handshake`: every connection must authenticate (two budgets, see the module doc); the
    protocol then calls `authenticated` once it has, and asks `eviction` why a pending connection
    was cut. `timeout`: the kernel timeouts of each accepted socket (default: the limits' tick)."""

    def __init__(self, sockets: Sequence[socket.socket], serve: Callable[[socket.socket, Any], None], name: str,
                 timeout: float | None = None, buffers: int = 0, limits: Limits | None = None,
                 refuse: Callable[[socket.socket, str], None] | None = None, handshake: bool = False):
        self.sockets = [s for s in sockets if s is not None]
        self._serve = serve
        self.name = name
        self._tune = (timeout, buffers)
        self.limits = limits or NO_LIMITS
        self.handshake = handshake
        self._refuse = refuse
        self._refusing = threading.BoundedSemaphore(MAX_REFUSING)
        self.refused = 0  # connections refused or evicted at a cap (for tests and stats)
        self._conns: set[socket.socket] = set()  # every live accepted socket (to wake at close)
        self._lock = threading.Lock()
        # without handshake: connections per peer address
        self._per_peer: dict[Any, int] = {}
        # with handshake: pending sockets in accept order (socket -> (peer, deadline)), per peer too
        self._pending: OrderedDict[socket.socket, tuple[Any, float]] = OrderedDict()
        self._pending_of: dict[Any, OrderedDict[socket.socket, None]] = {}
        self._evicted: dict[socket.socket, str] = {}
        self._principal_of: dict[socket.socket, Any] = {}  # authenticated socket -> its principal key
        self._per_principal: dict[Any, int] = {}
        self.closed = False
        self._threads = [threading.Thread(target=self._accept_loop, args=(s,), name=f"{name}-accept", daemon=True)
                         for s in self.sockets]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def close(self) -> None:
        self.closed = True
        for listener in self.sockets:
            shutdown(listener)
            listener.close()
        with self._lock:
            conns = list(self._conns)
        for sock in conns:
            shutdown(sock)  # wakes its thread, which closes it
        for t in self._threads:
            if t.is_alive():
                t.join(timeout=5)

    # -- counts ---------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Connections accepted and not yet authenticated."""
        return len(self._pending)

    @property
    def established(self) -> int:
        """Connections counted against `max_connections`."""
        return len(self._principal_of) if self.handshake else len(self._conns)

    def authenticated(self, sock: socket.socket, key: Any = None) -> str | None:
        """`sock` proved who it is (`key`: its principal, None: not capped per principal). Moves it
        from the unauthenticated budget to the authenticated one; returns why it is refused
        instead (evicted meanwhile, or over an authenticated cap), else None."""
        limits = self.limits
        with self._lock:
            why = self._evicted.get(sock)
            if why is not None:
                return why
            self._drop_pending(sock)
            if limits.max_connections and len(self._principal_of) >= limits.max_connections:
                why = (f"{self.name}: connection limit reached: {limits.max_connections} authenticated connections "
                       "are open (max_connections); try again later")
            elif (key is not None and limits.max_connections_per_principal
                  and self._per_principal.get(key, 0) >= limits.max_connections_per_principal):
                why = (f"{self.name}: connection limit reached: principal {key!r} already has "
                       f"{limits.max_connections_per_principal} connections open (max_connections_per_principal); "
                       "close some or reuse them")
            else:
                self._principal_of[sock] = key
                if key is not None:
                    self._per_principal[key] = self._per_principal.get(key, 0) + 1
                return None
        self.refused += 1
        log.warning("%s: refused an authenticated connection: %s", self.name, why)
        return why

    def eviction(self, sock: socket.socket) -> str | None:
        """Why pending `sock` was cut (evicted for a newer connection, or past its handshake
        deadline), or None. The protocol asks when its handshake read failed, to tell the client."""
        with self._lock:
            why = self._evicted.get(sock)
            if why is None:
                entry = self._pending.get(sock)
                if entry is not None and time.monotonic() >= entry[1]:
                    why = self._late()
        return why

    def handshake_deadline(self, sock: socket.socket) -> float:
        """Seconds `sock` has left to authenticate (the handshake timeout when none is set)."""
        entry = self._pending.get(sock)
        total = self.limits.handshake_timeout_s or 3600.0
        return total if entry is None else max(0.0, entry[1] - time.monotonic())

    def _late(self) -> str:
        return (f"{self.name}: authentication not finished within {self.limits.handshake_timeout_s:g}s of connecting "
                "(handshake_timeout_s)")

    def _drop_pending(self, sock: socket.socket) -> None:
        entry = self._pending.pop(sock, None)
        if entry is not None:
            queue = self._pending_of.get(entry[0])
            if queue is not None:
                queue.pop(sock, None)
                if not queue:
                    del self._pending_of[entry[0]]

    def _evict(self, sock: socket.socket, why: str, out: list[tuple[socket.socket, str]]) -> None:
        self._drop_pending(sock)
        self._evicted[sock] = why
        out.append((sock, why))

    def _admit_pending(self, sock: socket.socket, who: Any) -> list[tuple[socket.socket, str]]:
        """Add `sock` to the unauthenticated budget; the pending sockets it displaces (expired
        ones, then the oldest over a cap), with why."""
        limits = self.limits
        now = time.monotonic()
        out: list[tuple[socket.socket, str]] = []
        with self._lock:
            while self._pending:  # past their deadline (accept order = deadline order)
                oldest, (_, deadline) = next(iter(self._pending.items()))
                if deadline > now:
                    break
                self._evict(oldest, self._late(), out)
            mine = self._pending_of.get(who)
            if limits.max_unauthenticated_per_peer and mine and len(mine) >= limits.max_unauthenticated_per_peer:
                self._evict(next(iter(mine)), (
                    f"{self.name}: {UNAUTHENTICATED}: {who} has {limits.max_unauthenticated_per_peer} connections that "
                    "have not authenticated (max_unauthenticated_per_peer); its oldest, this one, was closed. "
                    "A client must authenticate right after it connects (docs/security.md)"), out)
            elif limits.max_unauthenticated and len(self._pending) >= limits.max_unauthenticated:
                self._evict(next(iter(self._pending)), (
                    f"{self.name}: {UNAUTHENTICATED}: {limits.max_unauthenticated} connections have not "
                    "authenticated (max_unauthenticated); the oldest, this one, was closed. A client must "
                    "authenticate right after it connects (docs/security.md)"), out)
            self._conns.add(sock)
            deadline = now + (limits.handshake_timeout_s or 3600.0)
            self._pending[sock] = (who, deadline)
            self._pending_of.setdefault(who, OrderedDict())[sock] = None
        return out

    # -- accepting ------------------------------------------------------------------------------
    def _accept_loop(self, listener: socket.socket) -> None:
        while not self.closed:
            try:
                sock, peer = listener.accept()
            except OSError:
                if self.closed:
                    return
                log.exception("%s: accept failed", self.name)
                continue
            tune(sock, *self._tune)
            if self._tune[0] is None and self.limits.tick:
                set_io_timeout(sock, self.limits.tick)
            who = peer[0] if isinstance(peer, tuple) and peer else "unix"
            if self.handshake:
                for victim, why in self._admit_pending(sock, who):
                    self.refused += 1
                    log.warning("%s: closed a connection that had not authenticated: %s", self.name, why)
                    try:
                        victim.shutdown(socket.SHUT_RD)  # its thread wakes, tells the client why, closes it
                    except OSError:
                        pass
            else:
                over = self._admit_open(sock, who)
                if over is not None:
                    self.refused += 1
                    log.warning("%s: refused a connection from %s: %s", self.name, who, over)
                    self._refuse_later(sock, over)
                    continue
            threading.Thread(target=self._run, args=(sock, peer, who), name=f"{self.name}-conn", daemon=True).start()

    def _admit_open(self, sock: socket.socket, who: Any) -> str | None:
        """Without authentication: count `sock` at accept, or say why it is over a cap."""
        limits = self.limits
        with self._lock:
            if limits.max_connections and len(self._conns) >= limits.max_connections:
                return (f"{self.name}: at its cap of {limits.max_connections} connections (max_connections); "
                        "try again later")
            if limits.max_connections_per_peer and self._per_peer.get(who, 0) >= limits.max_connections_per_peer:
                return (f"{self.name}: {who} already has {limits.max_connections_per_peer} connections open "
                        "(max_connections_per_peer); close some or reuse them")
            self._conns.add(sock)
            self._per_peer[who] = self._per_peer.get(who, 0) + 1
        return None

    def _refuse_later(self, sock: socket.socket, message: str) -> None:
        if self._refuse is None or not self._refusing.acquire(blocking=False):
            sock.close()
            return

        def run() -> None:
            try:
                set_io_timeout(sock, 0.5)
                self._refuse(sock, message)
            except OSError:
                pass
            finally:
                sock.close()
                self._refusing.release()

        threading.Thread(target=run, name=f"{self.name}-refuse", daemon=True).start()

    def _run(self, sock: socket.socket, peer: Any, who: Any = None) -> None:
        try:
            self._serve(sock, peer)
        finally:
            with self._lock:
                self._conns.discard(sock)
                if self.handshake:
                    self._drop_pending(sock)
                    self._evicted.pop(sock, None)
                    if sock in self._principal_of:
                        key = self._principal_of.pop(sock)
                        if key is not None:
                            left = self._per_principal.get(key, 1) - 1
                            if left > 0:
                                self._per_principal[key] = left
                            else:
                                self._per_principal.pop(key, None)
                else:
                    left = self._per_peer.get(who, 1) - 1
                    if left > 0:
                        self._per_peer[who] = left
                    else:
                        self._per_peer.pop(who, None)
            sock.close()
