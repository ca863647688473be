"""`kvpool bench transfer`: each transport between two processes, against its ceiling.

- shm: reads out of a peer's /dev/shm segment vs. a single-thread memcpy of the same bytes;
- tcp: reads and writes through the engine vs. a plain Python socket pair moving the same bytes
  with `sendall`/`recv_into` (one connection, streaming: the loopback ceiling);
- small ops (64 KiB): per-op latency p50/p99 of a synchronous read vs. one request/response
  round trip on the plain socket pair;
- Mooncake's TCP transfer engine, when `mooncake-transfer-engine-non-cuda` is installed.

The peer (a TransferEngine plus the plain-socket server) runs in a spawned process; ours and
the baseline alternate (see report.alternate).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import struct
import threading
import time

import click
import numpy as np

from kvpool.tools.bench.report import Report, alternate, gbps, progress
from kvpool.config import parse_size

log = logging.getLogger("kvpool.tools.bench.transfer")

_PLAIN = struct.Struct("<cQQ")  # mode (b"R": server sends, b"W": server receives), size, count


# -- the peer process ---------------------------------------------------------------------------
def _plain_server(listener: socket.socket, view: memoryview) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=_plain_conn, args=(conn, view), daemon=True).start()


def _plain_conn(conn: socket.socket, view: memoryview) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    hdr = bytearray(_PLAIN.size)
    try:
        while True:
            if conn.recv_into(hdr, len(hdr), socket.MSG_WAITALL) < len(hdr):
                return
            mode, size, count = _PLAIN.unpack(hdr)
            chunk = view[:size]
            for _ in range(count):
                if mode == b"R":
                    conn.sendall(chunk)
                else:
                    got = 0
                    while got < size:
                        got += conn.recv_into(chunk[got:], size - got)
                    if mode == b"A":  # request/response with an ack
                        conn.sendall(b"k")
    except OSError:
        return
    finally:
        conn.close()


def _peer_main(pipe, seg_size: int) -> None:
    from transfer import TransferEngine, create_shm_buffer

    engine = TransferEngine(name="bench-peer", transports=["shm", "tcp"]).start()
    mapping, path = create_shm_buffer(seg_size)
    np.frombuffer(mapping, dtype=np.uint8)[:] = 7
    try:
        desc = engine.register(mapping, name="bench", shm_path=path)
        listener = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=_plain_server, args=(listener, memoryview(bytearray(seg_size))), daemon=True).start()
        pipe.send((desc.to_bytes(), listener.getsockname()[1]))
        pipe.recv()  # run until told to stop
        listener.close()
    finally:
        engine.close()
        os.unlink(path)


# -- the plain socket pair (baseline) -----------------------------------------------------------
class PlainSocket:
    """One loopback connection to the peer's plain server: the ceiling for `tcp`."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def read(self, view: memoryview, size: int, count: int) -> None:
        self.sock.sendall(_PLAIN.pack(b"R", size, count))
        chunk = view[:size]
        for _ in range(count):
            got = 0
            while got < size:
                got += self.sock.recv_into(chunk[got:], size - got)

    def write(self, view: memoryview, size: int, count: int) -> None:
        self.sock.sendall(_PLAIN.pack(b"W", size, count))
        chunk = view[:size]
        for _ in range(count):
            self.sock.sendall(chunk)
        self.read(view, 1, 1)  # a round trip so all bytes have arrived before the clock stops

    def close(self) -> None:
        self.sock.close()


# -- the bench ------------------------------------------------------------------------------------
@click.command("transfer")
@click.option("--json", "as_json", is_flag=True, help="End the output with one JSON line.")
@click.option("--sizes", default="64KiB,1MiB,8MiB,64MiB", show_default=True, help="Op sizes.")
@click.option("--total", default="128MiB", show_default=True, help="Bytes moved per measurement.")
@click.option("--reps", default=7, show_default=True, type=click.IntRange(1), help="Alternating repetitions.")
@click.option("--latency-ops", default=2000, show_default=True, type=click.IntRange(10), help="Ops per latency run.")
@click.option("--mooncake/--no-mooncake", default=True, show_default=True,
              help="Also compare with Mooncake's TCP transfer engine when it is installed.")
def transfer(as_json: bool, sizes: str, total: str, reps: int, latency_ops: int, mooncake: bool) -> None:
    """Throughput of shm and tcp between two processes vs. memcpy and a plain socket pair."""
    from transfer import READ, WRITE, Op, SegmentDescriptor, TransferEngine

    size_list = [parse_size(s) for s in sizes.split(",") if s]
    total_bytes = parse_size(total)
    seg_size = max(max(size_list), 1 << 20)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_peer_main, args=(child, seg_size), daemon=True)
    proc.start()
    report = Report("transfer")
    try:
        desc_bytes, plain_port = parent.recv()
        seg = SegmentDescriptor.from_bytes(desc_bytes)
        engine = TransferEngine(name="bench-client", transports=["shm", "tcp"]).start()
        plain = PlainSocket(plain_port)
        local = np.zeros(max(total_bytes, seg_size), dtype=np.uint8)
        src = np.ones(seg_size, dtype=np.uint8)
        lview = memoryview(local)

        def ops(opcode: int, size: int) -> tuple[list, int]:
            count = max(1, total_bytes // size)
            per_seg = max(1, seg_size // size)
            return [Op(opcode, local, i * size, seg, (i % per_seg) * size, size) for i in range(count)], count

        steps = len(size_list) * 3 * (reps + 1) + 2 * (reps + 1)
        bar, advance = progress(steps, "bench transfer")
        with bar:
            for size in size_list:
                batch_r, count = ops(READ, size)
                batch_w, _ = ops(WRITE, size)
                moved = size * count

                def shm_read() -> float:
                    t = time.perf_counter()
                    engine.submit(batch_r, transport="shm").wait()
                    advance()
                    return gbps(moved, time.perf_counter() - t)

                def memcpy() -> float:
                    t = time.perf_counter()
                    per_seg = max(1, seg_size // size)
                    for i in range(count):
                        s = (i % per_seg) * size
                        lview[i * size:(i + 1) * size] = src[s:s + size].data
                    return gbps(moved, time.perf_counter() - t)

                mine, base = alternate(shm_read, memcpy, reps=reps)
                report.add("shm_read", mine, "GB/s", size=size, baseline="memcpy", baseline_values=base)

                def tcp(batch) -> float:
                    t = time.perf_counter()
                    engine.submit(batch, transport="tcp").wait()
                    advance()
                    return gbps(moved, time.perf_counter() - t)

                def plain_read() -> float:
                    t = time.perf_counter()
                    plain.read(lview, size, count)
                    return gbps(moved, time.perf_counter() - t)

                def plain_write() -> float:
                    t = time.perf_counter()
                    plain.write(lview, size, count)
                    return gbps(moved, time.perf_counter() - t)

                mine, base = alternate(lambda: tcp(batch_r), plain_read, reps=reps)
                report.add("tcp_read", mine, "GB/s", size=size, baseline="socket_pair", baseline_values=base)
                mine, base = alternate(lambda: tcp(batch_w), plain_write, reps=reps)
                report.add("tcp_write", mine, "GB/s", size=size, baseline="socket_pair", baseline_values=base)

            small = 64 << 10
            for transport in ("tcp", "shm"):
                lat = _latency(engine, seg, lview, small, latency_ops, transport, plain, advance, reps)
                for q, (mine, base) in lat.items():
                    report.add(f"{transport}_read_latency_{q}", mine, "us", size=small,
                               baseline="socket_pair_rtt" if transport == "tcp" else None,
                               baseline_values=base if transport == "tcp" else None)
        if mooncake:
            _mooncake(report, size_list, total_bytes, reps)
        plain.close()
        engine.close()
    finally:
        parent.send("stop")
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    report.emit(as_json)


def _latency(engine, seg, lview, size, n, transport, plain, advance, reps) -> dict[str, tuple[list, list]]:
    """p50/p99 of one synchronous `size`-byte read (us), per rep; baseline: a plain round trip."""
    out: dict[str, tuple[list, list]] = {"p50": ([], []), "p99": ([], [])}
    ops_view = lview[:size]

    def ours() -> tuple[float, float]:
        times = np.empty(n)
        for i in range(n):
            t = time.perf_counter()
            engine.read(seg, 0, ops_view, 0, size, transport=transport)
            times[i] = time.perf_counter() - t
        advance()
        return float(np.percentile(times, 50) * 1e6), float(np.percentile(times, 99) * 1e6)

    def base() -> tuple[float, float]:
        times = np.empty(n)
        for i in range(n):
            t = time.perf_counter()
            plain.read(lview, size, 1)
            times[i] = time.perf_counter() - t
        return float(np.percentile(times, 50) * 1e6), float(np.percentile(times, 99) * 1e6)

    ours()
    base()
    for _ in range(reps):
        p50, p99 = ours()
        out["p50"][0].append(p50)
        out["p99"][0].append(p99)
        b50, b99 = base()
        out["p50"][1].append(b50)
        out["p99"][1].append(b99)
    return out


def _mooncake(report: Report, sizes: list[int], total_bytes: int, reps: int) -> None:
    """Mooncake's TCP transfer engine as a peer baseline, when its wheel is installed."""
    try:
        from mooncake.engine import TransferEngine as MooncakeEngine  # noqa: F401
    except ImportError:
        report.notes.append("mooncake-transfer-engine-non-cuda not installed: Mooncake comparison skipped "
                            "(pip install 'kvpool[mooncake]' to enable)")
        return
    try:
        from kvpool.tools.bench.transfer_mooncake import compare

        compare(report, sizes, total_bytes, reps)
    except Exception as exc:  # an optional peer must never sink the bench
        log.exception("mooncake comparison failed")
        report.notes.append(f"mooncake comparison failed: {exc}")
