"""`Listener`: accepts connections, gives each a thread, and keeps the connection caps
(`transfer.framing.Limits`) so that nobody without a credential can lock out those with one.

A server that authenticates every connection (`handshake=True`: the pool RPC and the transfer
data server with a keyring) keeps two budgets:

- **Unauthenticated**: a connection is *pending* from its accept until the protocol reports it
  authenticated (`authenticated`). At most `max_unauthenticated` are pending per server and
  `max_unauthenticated_per_peer` per peer address; a new connection over either cap takes the
  place of an older pending one (its peer's own first), which is told why in its protocol's words
  and closed. A pending connection that has sent nothing yet is *quiet*: it waits in one selector
  (`select` thread), costing a descriptor and no thread; its first byte gets it a thread for the
  handshake (*speaking*). Quiet ones are cut before speaking ones, oldest first, so a flood of
  idle sockets never cuts a client in the middle of its handshake. Every pending connection has
  `handshake_timeout_s` from its accept. Refusing the newcomer instead would let a reconnecting
  flood keep everyone out.
- **Authenticated**: `authenticated(sock, key)` moves a connection out of pending. At most
  `max_connections` per server and `max_connections_per_principal` per principal `key` (None: not
  capped per principal, e.g. the pool's own node principal); over either it is refused.

A server without authentication counts every connection at accept (a thread per listening socket
blocked in `accept`): `max_connections` per server and `max_connections_per_peer` per peer
address; a new connection over either is refused.

Invariants: every accepted socket is in exactly one of quiet, speaking, established (counted) or
refused (being answered), and leaves the counts when it is closed; a cut socket leaves pending at
once, so the counts never include it. Only the select thread touches the selector.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections import Counter, OrderedDict
from typing import Any, Callable, Sequence

from transfer.framing import DONTWAIT, NO_LIMITS, Limits, refuse_after, set_io_timeout, shutdown, tune

log = logging.getLogger("transfer.framing")

MAX_REFUSING = 16  # refusals being answered at once; beyond, a refused connection is just closed
UNAUTHENTICATED = "connection limit for unauthenticated peers reached"
ACCEPTS_PER_WAKE = 64  # connections taken from one listening socket before looking at the others


class _Pending:
    __slots__ = ("peer", "who", "deadline", "quiet")

    def __init__(self, peer: Any, who: Any, deadline: float):
        self.peer = peer  # what `accept` returned
        self.who = who  # the peer address the caps count by
        self.deadline = deadline
        self.quiet = True


class Listener:
    """Accepts connections on `sockets` (listening) and serves each on a thread of its own:
    `serve(sock, peer)`, then the socket is closed. `close` stops accepting and wakes every
    connection's thread (its socket sees EOF); a thread's `serve` must return on that.

    `limits`: connection caps (see the module doc). `refusal(message)`: the protocol's error frame
    saying `message`, sent to a connection refused or cut before it spoke, which is then closed.
    `handshake`: every connection must authenticate (two budgets, see the module doc); the
    protocol then calls `authenticated` once it has, and asks `eviction` why a pending connection
    was cut. `timeout`: the kernel timeouts of each accepted socket (default: the limits' tick)."""

    def __init__(self, sockets: Sequence[socket.socket], serve: Callable[[socket.socket, Any], None], name: str,
                 timeout: float | None = None, buffers: int = 0, limits: Limits | None = None,
                 refusal: Callable[[str], bytes] | None = None, handshake: bool = False):
        self.sockets = [s for s in sockets if s is not None]
        self._serve = serve
        self.name = name
        self.limits = limits or NO_LIMITS
        self._tune = (self.limits.tick if timeout is None else timeout, buffers)
        self.handshake = handshake
        self._refusal = refusal
        self._refusing = threading.BoundedSemaphore(MAX_REFUSING)
        self._conns: set[socket.socket] = set()  # every accepted socket not yet closed (woken at close)
        self._lock = threading.Lock()
        # without handshake: connections per peer address
        self._per_peer: Counter = Counter()
        # with handshake: pending sockets, quiet and speaking, each in accept order, and per peer
        self._pending: dict[socket.socket, _Pending] = {}
        self._quiet: OrderedDict[socket.socket, None] = OrderedDict()
        self._speaking: OrderedDict[socket.socket, None] = OrderedDict()
        self._quiet_of: dict[Any, OrderedDict[socket.socket, None]] = {}
        self._speaking_of: dict[Any, OrderedDict[socket.socket, None]] = {}
        self._evicted: dict[socket.socket, str] = {}
        self._principal_of: dict[socket.socket, Any] = {}  # authenticated socket -> its principal key
        self._per_principal: Counter = Counter()
        self._to_close: list[tuple[socket.socket, str]] = []  # quiet sockets cut, for the select thread
        self.closed = False
        if handshake:
            self._selector = selectors.DefaultSelector()
            for s in self.sockets:
                s.setblocking(False)
                self._selector.register(s, selectors.EVENT_READ, None)
            self._listening = set(self.sockets)
            self._threads = [threading.Thread(target=self._select_loop, name=f"{name}-accept", daemon=True)]
        else:
            self._threads = [threading.Thread(target=self._accept_loop, args=(s,), name=f"{name}-accept",
                                              daemon=True) for s in self.sockets]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def close(self) -> None:
        self.closed = True
        for listener in self.sockets:
            shutdown(listener)
            if not self.handshake:
                listener.close()  # the select thread closes its own, having left the selector
        with self._lock:
            conns = list(self._conns)
        for sock in conns:
            shutdown(sock)  # wakes its thread, which closes it
        for t in self._threads:
            if t.is_alive():
                t.join(timeout=5)

    def authenticated(self, sock: socket.socket, key: Any = None) -> str | None:
        """`sock` proved who it is (`key`: its principal, None: not capped per principal). Moves it
        from the unauthenticated budget to the authenticated one; returns why it is refused
        instead (cut meanwhile, or over an authenticated cap), else None."""
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
                  and self._per_principal[key] >= limits.max_connections_per_principal):
                why = (f"{self.name}: connection limit reached: principal {key!r} already has "
                       f"{limits.max_connections_per_principal} connections open (max_connections_per_principal); "
                       "close some or reuse them")
            else:
                self._principal_of[sock] = key
                if key is not None:
                    self._per_principal[key] += 1
                return None
        log.warning("%s: refused an authenticated connection: %s", self.name, why)
        return why

    def eviction(self, sock: socket.socket) -> str | None:
        """Why pending `sock` was cut (for a newer connection, or past its handshake deadline), or
        None. The protocol asks when its handshake read failed, to tell the client."""
        with self._lock:
            why = self._evicted.get(sock)
            if why is None:
                entry = self._pending.get(sock)
                if entry is not None and time.monotonic() >= entry.deadline:
                    why = self._late()
        return why

    def handshake_deadline(self, sock: socket.socket) -> float:
        """Seconds `sock` has left to authenticate (the handshake timeout when none is set)."""
        entry = self._pending.get(sock)
        total = self.limits.handshake_timeout_s or 3600.0
        return total if entry is None else max(0.0, entry.deadline - time.monotonic())

    def _late(self) -> str:
        return (f"{self.name}: authentication not finished within {self.limits.handshake_timeout_s:g}s of connecting "
                "(handshake_timeout_s)")

    # -- the unauthenticated budget (under self._lock) -------------------------------------------
    def _drop_pending(self, sock: socket.socket) -> _Pending | None:
        entry = self._pending.pop(sock, None)
        if entry is not None:
            queues, by_peer = (self._quiet, self._quiet_of) if entry.quiet else (self._speaking, self._speaking_of)
            queues.pop(sock, None)
            mine = by_peer.get(entry.who)
            if mine is not None:
                mine.pop(sock, None)
                if not mine:
                    del by_peer[entry.who]
        return entry

    def _cut(self, sock: socket.socket, why: str) -> None:
        """Take pending `sock` out of the budget for `why`: a quiet one is closed by the select
        thread (its protocol's refusal first), a speaking one's thread is woken to answer."""
        entry = self._drop_pending(sock)
        if entry is not None and entry.quiet:
            self._to_close.append((sock, why))
            return
        self._evicted[sock] = why
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RD)  # its thread wakes, tells the client why, closes it

    def _sweep(self, now: float) -> None:
        """Cut pending sockets past their deadline (accept order is deadline order)."""
        for queue in (self._quiet, self._speaking):
            while queue:
                oldest = next(iter(queue))
                if self._pending[oldest].deadline > now:
                    break
                self._cut(oldest, self._late())

    def _admit_pending(self, sock: socket.socket, peer: Any, who: Any, now: float) -> None:
        """Add `sock` to the unauthenticated budget, cutting what it displaces: first pending
        sockets past their deadline, then over a cap the oldest quiet (else speaking) socket of
        its peer, else of the server."""
        limits = self.limits
        self._sweep(now)
        of_peer = len(self._quiet_of.get(who, ())) + len(self._speaking_of.get(who, ()))
        if limits.max_unauthenticated_per_peer and of_peer >= limits.max_unauthenticated_per_peer:
            victim = next(iter(self._quiet_of.get(who) or self._speaking_of[who]))
            self._cut(victim, (
                f"{self.name}: {UNAUTHENTICATED}: {who} has {limits.max_unauthenticated_per_peer} connections that "
                "have not authenticated (max_unauthenticated_per_peer), and this was the oldest. A client must "
                "authenticate right after it connects (docs/security.md)"))
        elif limits.max_unauthenticated and len(self._pending) >= limits.max_unauthenticated:
            victim = next(iter(self._quiet or self._speaking))
            self._cut(victim, (
                f"{self.name}: {UNAUTHENTICATED}: {limits.max_unauthenticated} connections have not authenticated "
                "(max_unauthenticated), and this was the oldest. A client must authenticate right after it "
                "connects (docs/security.md)"))
        self._conns.add(sock)
        self._pending[sock] = _Pending(peer, who, now + (limits.handshake_timeout_s or 3600.0))
        self._quiet[sock] = None
        self._quiet_of.setdefault(who, OrderedDict())[sock] = None

    def _speaks(self, sock: socket.socket) -> bool:
        """Quiet `sock` sent its first byte: it becomes speaking (False: it was cut meanwhile)."""
        entry = self._pending.get(sock)
        if entry is None or not entry.quiet:
            return False
        self._drop_pending(sock)
        entry.quiet = False
        self._pending[sock] = entry
        self._speaking[sock] = None
        self._speaking_of.setdefault(entry.who, OrderedDict())[sock] = None
        return True

    # -- accepting with a handshake: one selector ---------------------------------------------------
    def _select_loop(self) -> None:
        selector = self._selector
        try:
            while not self.closed:
                with self._lock:
                    first = min((self._pending[s].deadline for s in (next(iter(q), None) for q in
                                 (self._quiet, self._speaking)) if s is not None), default=None)
                wait = 0.5 if first is None else min(0.5, max(0.0, first - time.monotonic()))
                try:
                    events = selector.select(wait)
                except OSError:
                    if self.closed:
                        return
                    raise
                try:
                    self._on_events(events)
                except Exception:  # a bug here must not stop the server accepting
                    log.exception("%s: the accept loop failed on an event; carrying on", self.name)
        finally:
            self._close_all_quiet()
            for s in self.sockets:
                s.close()
            selector.close()

    def _on_events(self, events: list) -> None:
        """Quiet sockets that spoke get their threads (before any is cut for a newcomer), then
        new connections are accepted, then the deadlines are swept."""
        now = time.monotonic()
        started, listeners = [], []
        with self._lock:
            for key, _ in events:
                sock = key.fileobj
                if sock in self._listening:
                    listeners.append(sock)
                    continue
                self._selector.unregister(sock)
                if self._speaks(sock):
                    entry = self._pending[sock]
                    started.append((sock, entry.peer, entry.who))
        for sock, peer, who in started:
            self._start(sock, peer, who)
        for listener in listeners:
            self._accept_some(listener, now)
        with self._lock:
            self._sweep(now)
            cut, self._to_close = self._to_close, []
        self._close_cut(cut)

    def _accept_some(self, listener: socket.socket, now: float) -> None:
        for _ in range(ACCEPTS_PER_WAKE):
            try:
                sock, peer = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                if self.closed:
                    return
                log.exception("%s: accept failed", self.name)
                return
            sock.setblocking(True)
            tune(sock, *self._tune)
            who = peer[0] if isinstance(peer, tuple) and peer else "unix"
            if sock.family == getattr(socket, "AF_UNIX", None):
                spoke = True  # same host: a thread at once, so the protocol checks the peer's uid first
            else:
                try:  # a client that authenticates sends its hello with the connect: often here already
                    spoke = bool(sock.recv(1, socket.MSG_PEEK | DONTWAIT))
                except OSError:
                    spoke = False
            with self._lock:
                self._admit_pending(sock, peer, who, now)
                if spoke:
                    self._speaks(sock)
                cut, self._to_close = self._to_close, []
            self._close_cut(cut)
            if spoke:
                self._start(sock, peer, who)
            else:
                self._selector.register(sock, selectors.EVENT_READ, None)

    def _close_cut(self, cut: list[tuple[socket.socket, str]]) -> None:
        """Close quiet sockets that were cut, each told why in its protocol's words (it sent
        nothing, so it is reading nothing we could reset; the answer fits the socket buffer)."""
        for sock, why in cut:
            log.warning("%s: closed a connection that had not authenticated: %s", self.name, why)
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(sock)
            if self._refusal is not None:
                with contextlib.suppress(OSError):
                    sock.send(self._refusal(why), DONTWAIT)
            with self._lock:
                self._conns.discard(sock)
            sock.close()

    def _close_all_quiet(self) -> None:
        with self._lock:
            quiet = list(self._quiet)
            for sock in quiet:
                self._drop_pending(sock)
                self._conns.discard(sock)
        for sock in quiet:
            sock.close()

    # -- accepting without a handshake: a thread per listening socket -----------------------------
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
            who = peer[0] if isinstance(peer, tuple) and peer else "unix"
            over = self._admit_open(sock, who)
            if over is not None:
                log.warning("%s: refused a connection from %s: %s", self.name, who, over)
                self._refuse_later(sock, over)
                continue
            self._start(sock, peer, who)

    def _admit_open(self, sock: socket.socket, who: Any) -> str | None:
        """Without authentication: count `sock` at accept, or say why it is over a cap."""
        limits = self.limits
        with self._lock:
            if limits.max_connections and len(self._conns) >= limits.max_connections:
                return (f"{self.name}: at its cap of {limits.max_connections} connections (max_connections); "
                        "try again later")
            if limits.max_connections_per_peer and self._per_peer[who] >= limits.max_connections_per_peer:
                return (f"{self.name}: {who} already has {limits.max_connections_per_peer} connections open "
                        "(max_connections_per_peer); close some or reuse them")
            self._conns.add(sock)
            self._per_peer[who] += 1
        return None

    def _refuse_later(self, sock: socket.socket, message: str) -> None:
        if self._refusal is None or not self._refusing.acquire(blocking=False):
            sock.close()
            return

        def run() -> None:
            try:
                set_io_timeout(sock, 0.5)
                refuse_after(sock, self._refusal(message))
            except OSError:
                pass
            finally:
                sock.close()
                self._refusing.release()

        threading.Thread(target=run, name=f"{self.name}-refuse", daemon=True).start()

    # -- a connection's thread ----------------------------------------------------------------------
    def _start(self, sock: socket.socket, peer: Any, who: Any) -> None:
        threading.Thread(target=self._run, args=(sock, peer, who), name=f"{self.name}-conn", daemon=True).start()

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
                        _uncount(self._per_principal, self._principal_of.pop(sock))
                else:
                    _uncount(self._per_peer, who)
            sock.close()


def _uncount(counts: Counter, key: Any) -> None:
    """One connection of `key` (None: not counted) closed; a key with none left leaves `counts`."""
    if key is not None:
        counts[key] -= 1
        if counts[key] <= 0:
            del counts[key]
