"""Socket framing shared by the transfer engine's TCP transport and the pool's RPC.

Both move frames over blocking stream sockets whose payloads are received straight into their
destination (`recv_into`) and sent straight from their source (`sendmsg` of memoryviews), so
bulk bytes never pass through a Python `bytes`. This module holds the pieces both need:
socket options, kernel-side timeouts, exact receives (blocking or polling), gather sends, and
the `Listener` that gives each accepted connection a thread.

Errors: a peer that closes mid-frame raises `ConnectionError` (an `OSError`, which each
protocol maps to its own error type); a kernel timeout raises the `OSError` the socket gives.
Nothing here knows about a protocol's headers.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
from typing import Any, Callable, Sequence

log = logging.getLogger("transfer.framing")

IOV_MAX = 512  # buffers per sendmsg: well under the kernel's IOV_MAX
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
        tv = struct.pack("ll", int(timeout), int((timeout % 1) * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from a blocking socket. MSG_WAITALL: the kernel gathers the pieces (a unix
    socket delivers 64 KiB as two or three) instead of a return to Python per piece."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:] if got else view, n - got, WAITALL)
        if k == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {n} bytes")
        got += k


def recv_polling(sock: socket.socket, view: memoryview, polls: int) -> None:
    """`recv_exact_into`, polling while the bytes stream in: a large payload arrives in many
    pieces, and taking each as it lands (the sender copying on one core, us on the other) beats
    sleeping until MSG_WAITALL is satisfied, which wakes us per piece anyway. Blocks after
    `polls` empty polls in a row."""
    got, n, misses = 0, len(view), 0
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got, DONTWAIT)
        except BlockingIOError:
            misses += 1
            if misses < polls:
                sched_yield()
                continue
            k = sock.recv_into(view[got:], n - got, WAITALL)
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


def drain(sock: socket.socket, n: int) -> None:
    """Read and drop the next `n` bytes (a payload nobody wants: the stream stays in frame)."""
    scratch = memoryview(bytearray(min(n, 1 << 20)))
    while n > 0:
        k = min(n, len(scratch))
        recv_exact_into(sock, scratch[:k])
        n -= k


def shutdown(sock: socket.socket) -> None:
    """Wake whatever thread is blocked on `sock` (it sees EOF); errors ignored."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def peer_pid(sock: socket.socket) -> int:
    """The process id at the other end of a unix socket (0 when unknown)."""
    try:
        return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
    except (OSError, AttributeError):
        return 0


class Listener:
    """Accepts connections on `sockets` (listening) and serves each on a thread of its own:
    `serve(sock, peer)`, then the socket is closed. `close` stops accepting and wakes every
    connection's thread (its socket sees EOF); a thread's `serve` must return on that."""

    def __init__(self, sockets: Sequence[socket.socket], serve: Callable[[socket.socket, Any], None], name: str,
                 timeout: float | None = None, buffers: int = 0):
        self.sockets = [s for s in sockets if s is not None]
        self._serve = serve
        self.name = name
        self._tune = (timeout, buffers)
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
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
            with self._lock:
                self._conns.add(sock)
            threading.Thread(target=self._run, args=(sock, peer), name=f"{self.name}-conn", daemon=True).start()

    def _run(self, sock: socket.socket, peer: Any) -> None:
        try:
            self._serve(sock, peer)
        finally:
            with self._lock:
                self._conns.discard(sock)
            sock.close()
