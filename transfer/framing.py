"""Socket framing shared by the transfer engine's TCP transport and the pool's RPC.

Both move frames over blocking stream sockets whose payloads are received straight into their
destination (`recv_into`) and sent straight from their source (`sendmsg` of memoryviews), so
bulk bytes never pass through a Python `bytes`. (The `Listener` that gives each accepted
connection a thread and enforces the connection caps is `transfer.listener`.)

Errors: a peer that closes mid-frame raises `ConnectionError` (an `OSError`, which each
protocol maps to its own error type); a kernel timeout raises the `OSError` the socket gives.
Nothing here knows about a protocol's headers.

Limits (`Limits`, one per server): the `Listener` caps connections (a refused connection is
answered by the protocol's `refuse` and closed); each accepted socket gets one kernel receive timeout, a *tick* (`Limits.tick`), set once at accept, so the
hot path makes no timing syscalls. A receive that sees a whole tick pass without a byte raises
`BlockingIOError`; a server counts those ticks for its idle timeout and its header timeout, and
`recv_paced` cuts a body whose sender stalls (fewer than `min_body_rate` bytes per second over a
tick). So a stalled sender holds its thread for about one tick, not forever.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
from dataclasses import dataclass
from typing import Any, Sequence

log = logging.getLogger("transfer.framing")

IOV_MAX = 512  # buffers per sendmsg: well under the kernel's IOV_MAX
DRAIN_SCRATCH = 256 << 10  # what dropping an unwanted payload costs a connection
UNIX_SNDBUF = 4 << 20  # the kernel caps it at net.core.wmem_max
DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)
WAITALL = getattr(socket, "MSG_WAITALL", 0)
# Between two empty polls: let a runnable thread on this CPU (perhaps the very peer we wait
# for) run first; on an otherwise idle CPU it returns at once.
sched_yield = getattr(os, "sched_yield", lambda: None)


def tune(sock: socket.socket, timeout: float | None = None, buffers: int = 0) -> None:
    """Low latency (TCP_NODELAY), `buffers` bytes of kernel buffer each way (0: leave the
    kernel's autotuning alone) and, with `timeout`, a kernel-side timeout on each call.

    A unix stream gets a large send buffer: its sender blocks once `SO_SNDBUF` (default
    ~208 KiB) is in flight, and with the default a 256 KiB frame took several sleep/wake
    hand-offs between the two sides. The socket stays blocking (a Python-level timeout would
    turn every recv into poll + non-blocking recv and make MSG_WAITALL return early)."""
    if sock.family == socket.AF_UNIX:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, max(buffers, UNIX_SNDBUF))
        except OSError:
            pass
    else:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF) if buffers else ():
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, buffers)
            except OSError:
                pass
    if timeout is not None:
        sock.settimeout(None)
        set_io_timeout(sock, timeout)


def set_io_timeout(sock: socket.socket, seconds: float) -> None:
    """Kernel receive and send timeouts (the socket stays blocking; see `tune`): a send to a
    peer that stopped reading also gives up after a tick without progress."""
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def refuse_after(sock: socket.socket, answer: bytes) -> None:
    """Send `answer` (a protocol's refusal), then read what the peer already sent before the
    socket is closed: closing over unread bytes resets the connection, and the peer would see
    the reset instead of the answer. Bounded: at most 4 MiB or the socket's receive timeout."""
    try:
        sock.sendall(answer)
        sock.shutdown(socket.SHUT_WR)
        for _ in range(64):
            if not sock.recv(1 << 16):
                break
    except OSError:
        pass


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from a blocking socket. MSG_WAITALL: the kernel gathers the pieces (a unix
    socket delivers 64 KiB as two or three) instead of a return to Python per piece."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:] if got else view, n - got, WAITALL)
        if k == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {n} bytes")
        got += k


class Stalled(ConnectionError):
    """The peer sent a message body slower than the server's minimum rate (or not at all)."""


def recv_paced(sock: socket.socket, view: memoryview, min_per_tick: int) -> None:
    """`recv_exact_into` on a socket whose receive timeout is a tick: a call that comes back short
    has waited a whole tick (MSG_WAITALL returns early only then), and must have brought at
    least `min_per_tick` bytes, else the sender is cut (`Stalled`). No clock reads: a healthy
    sender fills `view` in one call."""
    got, n = 0, len(view)
    while got < n:
        try:
            k = sock.recv_into(view[got:] if got else view, n - got, WAITALL)
        except BlockingIOError:
            raise Stalled(f"peer sent nothing for a whole receive tick ({got} of {n} bytes in)") from None
        if k == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {n} bytes")
        got += k
        if got < n and k < min_per_tick:
            raise Stalled(f"peer sends too slowly ({k} bytes in a receive tick; {got} of {n} bytes in)")


def recv_polling(sock: socket.socket, view: memoryview, polls: int, min_per_tick: int = 0) -> None:
    """`recv_exact_into`, polling while the bytes stream in: a large payload arrives in many
    pieces, and taking each as it lands (the sender copying on one core, us on the other) beats
    sleeping until MSG_WAITALL is satisfied, which wakes us per piece anyway. Blocks after
    `polls` empty polls in a row; a blocking wait is paced as in `recv_paced`."""
    got, n, misses = 0, len(view), 0
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got, DONTWAIT)
        except BlockingIOError:
            misses += 1
            if misses < polls:
                sched_yield()
                continue
            try:
                k = sock.recv_into(view[got:], n - got, WAITALL)
            except BlockingIOError:
                raise Stalled(f"peer sent nothing for a whole receive tick ({got} of {n} bytes in)") from None
            if 0 < k < n - got and k < min_per_tick:
                raise Stalled(f"peer sends too slowly ({k} bytes in a receive tick; {got + k} of {n} bytes in)")
        if k == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {n} bytes")
        got += k
        misses = 0


def send_all(sock: socket.socket, buffers: Sequence[Any]) -> None:
    """Send every buffer in order with as few `sendmsg` calls as the kernel allows (a gather
    write: nothing is concatenated)."""
    views = [v if isinstance(v, memoryview) else memoryview(v) for v in buffers]
    views = [v.cast("B") if v.format != "B" or v.ndim != 1 else v for v in views if v.nbytes]
    i = 0
    while i < len(views):
        sent = sock.sendmsg(views[i:i + IOV_MAX])
        while sent:
            head = views[i]
            if sent >= len(head):
                sent -= len(head)
                i += 1
            else:
                views[i] = head[sent:]
                sent = 0


def drain(sock: socket.socket, n: int, min_per_tick: int = 0) -> None:
    """Read and drop the next `n` bytes (a payload nobody wants: the stream stays in frame).
    `min_per_tick`: as `recv_paced` (0: only a whole silent tick cuts the sender)."""
    scratch = memoryview(bytearray(min(n, DRAIN_SCRATCH)))
    while n > 0:
        k = min(n, len(scratch))
        recv_paced(sock, scratch[:k], min_per_tick)
        n -= k


def shutdown(sock: socket.socket) -> None:
    """Wake whatever thread is blocked on `sock` (it sees EOF); errors ignored."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def peer_closed(sock: socket.socket) -> bool:
    """Whether the other end has closed `sock` (EOF or an error waiting), without blocking: a
    pooled connection that sat idle may have been closed by the server's idle timeout."""
    try:
        return sock.recv(1, socket.MSG_PEEK | DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def peer_pid(sock: socket.socket) -> int:
    """The process id at the other end of a unix socket (0 when unknown)."""
    try:
        return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
    except (OSError, AttributeError):
        return 0


@dataclass(frozen=True)
class Limits:
    """What a server allows each connection; 0 turns a limit off.

    `header_timeout_s`: a frame header once started must complete within this (within two ticks:
    the check runs at tick ends); it is also the tick, the socket's receive timeout.
    `idle_timeout_s`: a connection with no request for this long is closed. `min_body_rate`: bytes
    per second a message body or payload in flight must keep up (a sender silent for a whole tick
    is cut even at 0).

    Connection caps (`transfer.listener.Listener`). On a server that authenticates every
    connection, two budgets: connections not yet authenticated (`max_unauthenticated` per server,
    `max_unauthenticated_per_peer` per peer address, each with `handshake_timeout_s` from accept to
    finish the handshake; a new one over a cap replaces the oldest), and authenticated ones
    (`max_connections` per server, `max_connections_per_principal` per principal). On a server
    without authentication: `max_connections` per server and `max_connections_per_peer` per peer
    address (IP; a unix socket's peers share one)."""

    header_timeout_s: float = 10.0
    idle_timeout_s: float = 300.0
    min_body_rate: int = 64 << 10
    max_connections: int = 1024
    max_connections_per_peer: int = 256
    max_unauthenticated: int = 1024
    max_unauthenticated_per_peer: int = 128
    handshake_timeout_s: float = 3.0
    max_connections_per_principal: int = 256

    @property
    def tick(self) -> float | None:
        return self.header_timeout_s or None

    @property
    def min_per_tick(self) -> int:
        return int(self.min_body_rate * self.header_timeout_s)

    def idle_ticks(self) -> int:
        """Silent ticks between requests before a connection is idle-closed (0: never)."""
        if not self.idle_timeout_s or not self.header_timeout_s:
            return 0
        return max(1, round(self.idle_timeout_s / self.header_timeout_s))


NO_LIMITS = Limits(0, 0, 0, 0, 0, 0, 0, 0, 0)
