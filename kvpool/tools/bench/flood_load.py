"""The flood `kvpool bench flood` runs against a pool, in a process of its own (so it takes no
CPU or GIL from the measuring client): idle TCP connections that never authenticate, spread over
several loopback source addresses, each reopened as soon as the server closes it.

    python -m kvpool.tools.bench.flood_load HOST PORT[,PORT...] COUNT

reads commands on stdin: `up` opens COUNT sockets (spread over the ports), answers `up N` once
every one has connected, then keeps them open (reopening what the server closes); `down` closes
them all and answers `down R` (R: sockets the server closed and the flood reopened); `quit` ends.
Each connect completes before the next starts, so none waits out a SYN retransmission behind a
full accept queue.
"""

from __future__ import annotations

import select
import socket
import sys
import threading

SOURCES = [f"127.0.0.{i}" for i in range(1, 9)]


class Flood:
    """`count` idle sockets spread over `ports` and `sources`, opened and kept open by one thread;
    what the server wrote to a socket before closing it is kept (up to 32 per port) in `told`."""

    def __init__(self, host: str, ports: list[int], count: int, sources: list[str] = SOURCES):
        self.host = host
        self.slots = [(ports[i % len(ports)], sources[(i // len(ports)) % len(sources)]) for i in range(count)]
        self.socks: dict[int, socket.socket] = {}  # slot -> its open socket
        self.told: dict[int, list[bytes]] = {port: [] for port in ports}
        self.reopened = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.up = threading.Event()

    def start(self) -> None:
        self._stop.clear()
        self.up.clear()
        self.reopened = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> int:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        for sock in self.socks.values():
            sock.close()
        self.socks.clear()
        return self.reopened

    def _connect(self, i: int) -> socket.socket | None:
        port, source = self.slots[i]
        try:
            return socket.create_connection((self.host, port), timeout=10, source_address=(source, 0))
        except OSError:
            return None

    def _run(self) -> None:
        poller = select.poll()
        by_fd: dict[int, int] = {}

        def open_slot(i: int) -> None:
            sock = self._connect(i)
            if sock is not None:
                self.socks[i] = sock
                by_fd[sock.fileno()] = i
                poller.register(sock.fileno(), select.POLLIN)

        def reopen_closed(wait_ms: int) -> None:
            for fd, _ in poller.poll(wait_ms):
                i = by_fd.pop(fd)
                poller.unregister(fd)
                sock = self.socks.pop(i)
                try:
                    data = sock.recv(4096)
                except OSError:
                    data = b""
                told = self.told[self.slots[i][0]]
                if data and len(told) < 32:
                    told.append(data)
                sock.close()
                self.reopened += 1
                if not self._stop.is_set():
                    open_slot(i)

        for i in range(len(self.slots)):
            if self._stop.is_set():
                return
            open_slot(i)
            if i % 64 == 63:
                reopen_closed(0)
        self.up.set()
        while not self._stop.is_set():
            reopen_closed(100)


def main(argv: list[str]) -> None:
    host, ports, count = argv[0], [int(p) for p in argv[1].split(",")], int(argv[2])
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = count + 256
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard) if hard > 0 else want, hard))
    flood = Flood(host, ports, count)
    for line in sys.stdin:
        command = line.strip()
        if command == "up":
            flood.start()
            flood.up.wait()
            print(f"up {len(flood.socks)}", flush=True)
        elif command == "down":
            print(f"down {flood.stop()}", flush=True)
        elif command == "quit":
            break
    flood.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
