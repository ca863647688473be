"""A small TCP proxy that injects network faults between two processes (toxiproxy-style).

    proxy = FaultProxy("127.0.0.1:2379").start()   # listens on proxy.address
    proxy.delay(0.2)        # every chunk forwarded 200 ms late (both directions)
    proxy.blackhole()       # connections stay open, nothing is forwarded (a silent partition)
    proxy.cut()             # every open connection is reset, new ones are refused (reset at once)
    proxy.heal()            # back to forwarding, no delay
    proxy.retarget(addr)    # later connections go to `addr` (e.g. the current leader master)

Invariants: a chunk is forwarded whole and in order, or not at all (a cut connection is closed
on both sides); a blackholed connection never forwards the data it held back, it is closed on
heal, as a partition that outlasts TCP's patience would leave it.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time

log = logging.getLogger(__name__)

FORWARD, DELAY, BLACKHOLE, CUT = "forward", "delay", "blackhole", "cut"


class FaultProxy:
    def __init__(self, upstream: str, name: str = "proxy"):
        self.upstream = upstream
        self.name = name
        self.mode = FORWARD
        self.latency = 0.0
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._server = socket.socket()
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(128)
        self.address = "127.0.0.1:%d" % self._server.getsockname()[1]
        self._closed = False

    def start(self) -> "FaultProxy":
        threading.Thread(target=self._accept_loop, name=f"{self.name}-accept", daemon=True).start()
        return self

    # ------------------------------------------------------------------ faults

    def delay(self, seconds: float) -> None:
        self.latency, self.mode = seconds, DELAY

    def blackhole(self) -> None:
        self.mode = BLACKHOLE

    def cut(self) -> None:
        self.mode = CUT
        self._reset_all()

    def heal(self) -> None:
        held_back = self.mode == BLACKHOLE
        self.mode, self.latency = FORWARD, 0.0
        if held_back:
            self._reset_all()

    def retarget(self, upstream: str) -> None:
        self.upstream = upstream

    def close(self) -> None:
        self._closed = True
        self._server.close()
        self._reset_all()

    # ------------------------------------------------------------------ plumbing

    def _reset_all(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, set()
        for s in conns:
            _reset(s)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            if self.mode == CUT:
                _reset(client)
                continue
            host, port = self.upstream.rsplit(":", 1)
            try:
                server = socket.create_connection((host, int(port)), timeout=2.0)
                server.settimeout(None)
            except OSError:
                _reset(client)
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.update((client, server))
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(src, dst), name=f"{self.name}-pump", daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                while self.mode == BLACKHOLE:
                    time.sleep(0.05)
                if self.mode == CUT or src not in self._conns:
                    break
                if self.mode == DELAY and self.latency > 0:
                    time.sleep(self.latency)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._conns.discard(src)
                self._conns.discard(dst)
            _reset(src)
            _reset(dst)


def _reset(s: socket.socket) -> None:
    """Close with RST (SO_LINGER 0), as a dropped connection looks to its peer."""
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv on it (close alone may not)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass
