"""Plain TCP over a fabric's links, no kvpool in the way: round trips (there is no `ping` here)
and the raw-socket baseline of `kvpool bench pool --netns`.

    python -m kvpool.tools.netns.probe serve 10.77.0.3        # prints "probe port N", serves until killed
    python -m kvpool.tools.netns.probe rtt 10.77.0.3 N 50     # 50 one-byte round trips, seconds on one line

A connection's first byte picks what the server does with it: `e` echoes bytes back (round
trips); `g` answers each 8-byte length with that many bytes (a get: one request, one payload);
`p` reads an 8-byte length and that many bytes, and answers one byte (a put).
"""

from __future__ import annotations

import socket
import struct
import sys
import threading
import time

CHUNK = 1 << 20


def serve(host: str) -> None:
    server = socket.create_server((host, 0))
    print(f"probe port {server.getsockname()[1]}", flush=True)
    while True:
        conn, _ = server.accept()
        threading.Thread(target=_serve_one, args=(conn,), daemon=True).start()


def _serve_one(conn: socket.socket) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = memoryview(bytearray(CHUNK))
    sink = bytearray(CHUNK)
    try:
        mode = conn.recv(1)
        while True:
            if mode == b"e":
                data = conn.recv(65536)
                if not data:
                    return
                conn.sendall(data)
                continue
            header = _recv_exact(conn, 8)
            if header is None:
                return
            (n,) = struct.unpack("<Q", header)
            if mode == b"g":
                while n > 0:
                    k = min(n, CHUNK)
                    conn.sendall(payload[:k])
                    n -= k
            elif mode == b"p":
                while n > 0:
                    k = conn.recv_into(sink, min(n, CHUNK))
                    if k == 0:
                        return
                    n -= k
                conn.sendall(b"k")
            else:
                return
    except OSError:
        pass
    finally:
        conn.close()


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    out = b""
    while len(out) < n:
        data = conn.recv(n - len(out))
        if not data:
            return None
        out += data
    return out


class RawClient:
    """One kept-open connection doing gets or puts of whole values (the bench's baseline)."""

    def __init__(self, host: str, port: int, mode: bytes):
        self.sock = socket.create_connection((host, port), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(mode)

    def get_into(self, out: memoryview) -> None:
        self.sock.sendall(struct.pack("<Q", len(out)))
        got = 0
        while got < len(out):
            k = self.sock.recv_into(out[got:])
            if k == 0:
                raise ConnectionError("the probe server closed the connection")
            got += k

    def put(self, data: memoryview) -> None:
        self.sock.sendall(struct.pack("<Q", len(data)))
        self.sock.sendall(data)
        if self.sock.recv(1) != b"k":
            raise ConnectionError("the probe server did not acknowledge a put")

    def close(self) -> None:
        self.sock.close()


def round_trips(host: str, port: int, samples: int) -> list[float]:
    s = socket.create_connection((host, port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.sendall(b"e")
    out = []
    for _ in range(samples):
        t = time.perf_counter()
        s.sendall(b"x")
        if s.recv(1) != b"x":
            raise ConnectionError("the echo did not come back")
        out.append(time.perf_counter() - t)
    s.close()
    return out


def main(argv: list[str]) -> None:
    if argv[:1] == ["serve"]:
        serve(argv[1])
    elif argv[:1] == ["rtt"]:
        print(" ".join(f"{x:.9f}" for x in round_trips(argv[1], int(argv[2]), int(argv[3]))))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
