"""Mooncake's TCP transfer engine as a peer baseline for `kvpool bench transfer`.

Only imported when `mooncake-transfer-engine-non-cuda` is installed (the `mooncake` extra).
Its peer runs in a spawned process with P2P handshake metadata (no metadata server); the
client reads the same sizes, batched like ours (one `batch_transfer_sync_read` per
measurement), and single 64 KiB reads for ops/s. Ours is measured again in the same
alternation so the ratio is same-run.
"""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np

from kvpool.tools.bench.report import Report, alternate, gbps


def _mooncake_peer(pipe, size: int) -> None:
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        pipe.send(None)
        return
    buf = np.full(size, 7, dtype=np.uint8)
    addr = int(buf.ctypes.data)
    engine.register_memory(addr, size)
    pipe.send((f"127.0.0.1:{engine.get_rpc_port()}", addr))
    pipe.recv()


def compare(report: Report, sizes: list[int], total_bytes: int, reps: int = 3) -> None:
    from mooncake.engine import TransferEngine as MooncakeEngine

    from transfer import READ, Op, SegmentDescriptor, TransferEngine
    from kvpool.tools.bench.transfer import _peer_main

    seg_size = max(max(sizes), 1 << 20)
    ctx = mp.get_context("spawn")
    mc_parent, mc_child = ctx.Pipe()
    our_parent, our_child = ctx.Pipe()
    mc_proc = ctx.Process(target=_mooncake_peer, args=(mc_child, seg_size), daemon=True)
    our_proc = ctx.Process(target=_peer_main, args=(our_child, seg_size), daemon=True)
    mc_proc.start()
    our_proc.start()
    try:
        hello = mc_parent.recv()
        if hello is None:
            report.notes.append("mooncake engine failed to initialize; comparison skipped")
            return
        target, remote_addr = hello
        seg = SegmentDescriptor.from_bytes(our_parent.recv()[0])
        mc = MooncakeEngine()
        if mc.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            report.notes.append("mooncake client failed to initialize; comparison skipped")
            return
        local = np.zeros(max(total_bytes, seg_size), dtype=np.uint8)
        local_addr = int(local.ctypes.data)
        mc.register_memory(local_addr, len(local))
        ours = TransferEngine(name="bench-mooncake-cmp", transports=["tcp"]).start()
        try:
            for size in sizes:
                count = max(1, total_bytes // size)
                per_seg = max(1, seg_size // size)
                offs = [(i % per_seg) * size for i in range(count)]
                batch = [Op(READ, local, i * size, seg, offs[i], size) for i in range(count)]
                mc_bufs = [local_addr + i * size for i in range(count)]
                mc_remote = [remote_addr + o for o in offs]
                lengths = [size] * count

                def run_ours() -> float:
                    t = time.perf_counter()
                    ours.submit(batch, transport="tcp").wait()
                    return gbps(size * count, time.perf_counter() - t)

                def run_mc() -> float:
                    t = time.perf_counter()
                    rc = mc.batch_transfer_sync_read(target, mc_bufs, mc_remote, lengths)
                    if rc != 0:
                        raise RuntimeError(f"mooncake batch read returned {rc}")
                    return gbps(size * count, time.perf_counter() - t)

                mine, base = alternate(run_ours, run_mc, reps=reps)
                report.add("tcp_read_vs_mooncake", mine, "GB/s", size=size, baseline="mooncake_tcp",
                           baseline_values=base)

            small, n = 64 << 10, 500
            view = memoryview(local)[:small]

            def ops_ours() -> float:
                t = time.perf_counter()
                for _ in range(n):
                    ours.read(seg, 0, view, 0, small, transport="tcp")
                return n / (time.perf_counter() - t)

            def ops_mc() -> float:
                t = time.perf_counter()
                for _ in range(n):
                    if mc.transfer_sync_read(target, local_addr, remote_addr, small) != 0:
                        raise RuntimeError("mooncake read failed")
                return n / (time.perf_counter() - t)

            mine, base = alternate(ops_ours, ops_mc, reps=reps)
            report.add("tcp_read_ops_vs_mooncake", mine, "ops/s", size=small, baseline="mooncake_tcp",
                       baseline_values=base)
        finally:
            ours.close()
    finally:
        for pipe, proc in ((mc_parent, mc_proc), (our_parent, our_proc)):
            try:
                pipe.send("stop")
            except OSError:
                pass
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
