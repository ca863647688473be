"""Plain TCP over a fabric's links, no kvpool in the way: round trips (there is no `ping` here)
and the raw-socket baselines of `kvpool bench pool --netns`.

    python -m kvpool.tools.netns.probe serve 10.77.0.3        # prints "probe port N", serves until killed
    python -m kvpool.tools.netns.probe rtt 10.77.0.3 N 50     # 50 one-byte round trips, seconds on one line

A connection's first byte picks what the server does with it:
- `e`: echoes bytes back (round trips);
- `s`: answers each 8-byte length with that many bytes (a stream: what the link carries);
- `k`: a key-value store in a dict, the least a store over a socket can do (`RawStore`):
  `P` key value -> `k`; `G` key -> 8-byte length + value (length 2**64-1: a miss); `D` key -> `k`.
"""

from __future__ import annotations

import socket
import struct
import sys
import threading
import time

CHUNK = 1 << 20
MISS = (1 << 64) - 1
_HEAD = struct.Struct("<cHQ")  # op, key length, value length (P) or 0


def serve(host: str) -> None:
    server = socket.create_server((host, 0))
    print(f"probe port {server.getsockname()[1]}", flush=True)
    store: dict[bytes, bytearray] = {}
    while True:
        conn, _ = server.accept()
        threading.Thread(target=_serve_one, args=(conn, store), daemon=True).start()


def _serve_one(conn: socket.socket, store: dict[bytes, bytearray]) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        mode = conn.recv(1)
        if mode == b"e":
            while data := conn.recv(65536):
                conn.sendall(data)
        elif mode == b"s":
            zeros = memoryview(bytearray(CHUNK))
            while (header := _recv_exact(conn, 8)) is not None:
                (n,) = struct.unpack("<Q", header)
                while n > 0:
                    k = min(n, CHUNK)
                    conn.sendall(zeros[:k])
                    n -= k
        elif mode == b"k":
            _serve_store(conn, store)
    except OSError:
        pass
    finally:
        conn.close()


def _serve_store(conn: socket.socket, store: dict[bytes, bytearray]) -> None:
    while (head := _recv_exact(conn, _HEAD.size)) is not None:
        op, key_len, size = _HEAD.unpack(head)
        key = _recv_exact(conn, key_len)
        if key is None:
            return
        if op == b"P":
            value = bytearray(size)
            view, got = memoryview(value), 0
            while got < size:
                k = conn.recv_into(view[got:])
                if k == 0:
                    return
                got += k
            store[key] = value
            conn.sendall(b"k")
        elif op == b"G":
            value = store.get(key)
            if value is None:
                conn.sendall(struct.pack("<Q", MISS))
            else:
                conn.sendall(struct.pack("<Q", len(value)))
                conn.sendall(value)
        elif op == b"D":
            store.pop(key, None)
            conn.sendall(b"k")
        else:
            return


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    out = bytearray()
    while len(out) < n:
        data = conn.recv(n - len(out))
        if not data:
            return None
        out += data
    return bytes(out)


def _connect(host: str, port: int, mode: bytes) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=60)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(mode)
    return sock


def _recv_into(sock: socket.socket, out: memoryview) -> None:
    got = 0
    while got < len(out):
        k = sock.recv_into(out[got:])
        if k == 0:
            raise ConnectionError("the probe server closed the connection")
        got += k


class RawStore:
    """A client of the `k` store over one kept-open connection: what the pool's get and put are
    measured against over the same link (one request, one payload; a batch is pipelined: every
    request sent, then every answer read)."""

    def __init__(self, host: str, port: int):
        self.sock = _connect(host, port, b"k")

    def put(self, key: str, value: memoryview) -> None:
        k = key.encode()
        self.sock.sendall(_HEAD.pack(b"P", len(k), len(value)) + k)
        self.sock.sendall(value)
        self._ack()

    def get_into(self, key: str, out: memoryview) -> int:
        k = key.encode()
        self.sock.sendall(_HEAD.pack(b"G", len(k), 0) + k)
        return self._value_into(key, out)

    def get_batch_into(self, keys: list[str], outs: list[memoryview]) -> None:
        self.sock.sendall(b"".join(_HEAD.pack(b"G", len(k.encode()), 0) + k.encode() for k in keys))
        for key, out in zip(keys, outs):
            self._value_into(key, out)

    def remove(self, key: str) -> None:
        k = key.encode()
        self.sock.sendall(_HEAD.pack(b"D", len(k), 0) + k)
        self._ack()

    def close(self) -> None:
        self.sock.close()

    def _value_into(self, key: str, out: memoryview) -> int:
        head = bytearray(8)
        _recv_into(self.sock, memoryview(head))
        (n,) = struct.unpack("<Q", head)
        if n == MISS:
            raise KeyError(key)
        if n > len(out):
            raise ValueError(f"{key}: {n} bytes do not fit a {len(out)}-byte buffer")
        _recv_into(self.sock, memoryview(out)[:n])
        return n

    def _ack(self) -> None:
        if self.sock.recv(1) != b"k":
            raise ConnectionError("the probe server did not acknowledge")


def stream(host: str, port: int, nbytes: int) -> float:
    """Seconds to receive `nbytes` in one stream (a fresh connection, reading into one buffer)."""
    sock = _connect(host, port, b"s")
    buf = memoryview(bytearray(CHUNK))
    try:
        start = time.perf_counter()
        sock.sendall(struct.pack("<Q", nbytes))
        left = nbytes
        while left > 0:
            k = sock.recv_into(buf, min(left, CHUNK))
            if k == 0:
                raise ConnectionError("the probe server closed the stream")
            left -= k
        return time.perf_counter() - start
    finally:
        sock.close()


def round_trips(host: str, port: int, samples: int) -> list[float]:
    sock = _connect(host, port, b"e")
    out = []
    try:
        for _ in range(samples):
            t = time.perf_counter()
            sock.sendall(b"x")
            if sock.recv(1) != b"x":
                raise ConnectionError("the echo did not come back")
            out.append(time.perf_counter() - t)
    finally:
        sock.close()
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
