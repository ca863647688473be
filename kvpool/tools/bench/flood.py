"""`kvpool bench flood`: an authenticated tenant's latency while unauthenticated connections flood
the pool, against the same pool quiet, in the same run (issue 27).

Setup: `kvpool serve` with a keyring (a node and the tenant `bench`) in a child process; a flood
process (`flood_load`) holding `--connections` idle TCP connections that never authenticate,
spread over the pool RPC port and the transfer data port and over eight loopback source
addresses, each reopened as soon as the server closes it (so the server is cutting and
accepting the whole time: the worst case, not a quiet backlog); this process is the tenant, a
client as on another host (loopback TCP, no shared memory), on the node-RPC path and on the
transfer-engine path (`--data-path`).

Each repetition runs a quiet phase and a flooded phase (the order alternates; a flooded phase
starts `--settle-s` after the flood is up, past the server's handshake deadline, so sockets are
being cut and reopened throughout) with a fresh connection set: `--connects` new connections (connect + handshake + hello, timed), then `--ops`
puts and `--ops` gets of `--size` bytes, one at a time, each timed. Reported per path and
operation: the p99 of the flooded phase (median over repetitions) against the quiet phase's
(ratio = quiet / flooded: higher is better, 1 = no effect); p50s, the operations that failed and
the sockets the server cut are in `extra`. Goal: ratio >= 0.5 (p99 within 2x of quiet), no failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import click
import numpy as np

from kvpool.config import parse_size
from kvpool.tools.bench.pool_process import auth_pool
from kvpool.tools.bench.report import Report, progress

GOAL = 0.5  # quiet p99 / flooded p99


@click.command()
@click.option("--connections", type=int, default=2000, show_default=True,
              help="Idle unauthenticated connections the flood holds (half per port).")
@click.option("--ops", type=int, default=300, show_default=True, help="Puts and gets per phase.")
@click.option("--connects", type=int, default=20, show_default=True, help="New tenant connections per phase.")
@click.option("--size", default="64KiB", show_default=True, help="Value size.")
@click.option("--reps", type=int, default=3, show_default=True, help="Repetitions of quiet + flooded (after a warm-up).")
@click.option("--settle-s", type=float, default=4.0, show_default=True,
              help="Seconds the flood stands before a flooded phase is measured (past the 3 s handshake deadline, "
                   "so the server is closing and the flood reopening sockets meanwhile).")
@click.option("--data-path", "data_paths", multiple=True, type=click.Choice(["rpc", "engine"]),
              help="Tenant data paths (default: both).")
@click.option("--json", "as_json", is_flag=True)
def flood(connections, ops, connects, size, reps, settle_s, data_paths, as_json) -> None:
    """Tenant put/get/connect p99 under a flood of idle unauthenticated connections vs quiet."""
    size = parse_size(size)
    data_paths = data_paths or ("rpc", "engine")
    report = Report("flood")
    report.setup = {"connections": connections, "ops": ops, "connects": connects, "size": size, "reps": reps,
                    "settle_s": settle_s, "data_paths": list(data_paths)}
    server, credential, cleanup = auth_pool(max(64 << 20, 4 * ops * size))
    load = None
    try:
        server.settle()
        ports = _ports(server.address, credential)
        load = subprocess.Popen([sys.executable, "-m", "kvpool.tools.bench.flood_load", "127.0.0.1",
                                 ",".join(map(str, ports)), str(connections)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        samples: dict[str, dict[str, list]] = {}
        bar, step = progress((reps + 1) * 2 * len(data_paths), "flood")
        with bar:
            for rep in range(reps + 1):  # rep 0 warms up
                order = ("quiet", "flooded") if rep % 2 else ("flooded", "quiet")
                for phase in order:
                    cut = 0
                    if phase == "flooded":
                        _tell(load, "up")
                        time.sleep(settle_s)
                    for path in data_paths:
                        got = _phase(server.address, credential, path, ops, connects, size, f"{rep}{phase}")
                        if rep:
                            for op, values in got.items():
                                samples.setdefault(f"{path}/{op}", {}).setdefault(phase, []).append(values)
                        step()
                    if phase == "flooded":
                        cut = int(_tell(load, "down").split()[1])
                        if rep:
                            samples.setdefault("cut", {}).setdefault("flooded", []).append(cut)
        cuts = samples.pop("cut", {}).get("flooded", [])
        for case, phases in samples.items():
            ours = [_p(v, 99) for v in phases["flooded"]]
            base = [_p(v, 99) for v in phases["quiet"]]
            failed = {p: sum(int(np.isnan(v).sum()) for v in phases[p]) for p in phases}
            report.add(f"{case}_p99", ours, "ms", size=size, baseline="quiet", baseline_values=base,
                       extra={"p50": round(float(np.median([_p(v, 50) for v in phases["flooded"]])), 4),
                              "p50_quiet": round(float(np.median([_p(v, 50) for v in phases["quiet"]])), 4),
                              "failed": failed["flooded"], "failed_quiet": failed["quiet"],
                              "samples": int(sum(len(v) for v in phases["flooded"]))})
        report.notes.append(
            f"{connections} idle unauthenticated connections (half on the RPC port, half on the data port, 8 source "
            f"addresses, reopened as the server cuts them: {int(np.median(cuts)) if cuts else 0} cut per flooded "
            f"phase, median); tenant over loopback TCP without shm; goal: ratio >= {GOAL} (p99 within 2x), no failure")
        missed = [r.case for r in report.results if r.ratio is None or r.ratio < GOAL or r.extra.get("failed")]
        report.notes.append("goal met" if not missed else f"goal missed: {', '.join(missed)}")
    finally:
        if load is not None:
            try:
                load.communicate("quit\n", timeout=30)
            except subprocess.TimeoutExpired:
                load.kill()
        cleanup()
    report.emit(as_json)


def _ports(address: str, credential: Any) -> list[int]:
    """The pool's RPC port and its node's transfer data port (from the hello, as a tenant)."""
    from kvpool import messages as m
    from kvpool.rpc import RpcClient
    from transfer import SegmentDescriptor

    rpc = RpcClient(address, credential=credential)
    try:
        hello = rpc.call(m.Hello(m.PROTOCOL_VERSION, "bench-flood"))
    finally:
        rpc.close()
    return [int(address.rsplit(":", 1)[1]), SegmentDescriptor.from_bytes(hello.node.transfer_segment).port]


def _tell(load: subprocess.Popen, command: str) -> str:
    load.stdin.write(command + "\n")
    load.stdin.flush()
    answer = load.stdout.readline().strip()
    if not answer.startswith(command):
        raise RuntimeError(f"the flood process answered {answer!r} to {command!r}")
    return answer


def _phase(address: str, credential: Any, path: str, ops: int, connects: int, size: int,
           tag: str) -> dict[str, list[float]]:
    """One phase on one path: connect, put, get latencies in ms (NaN: the operation failed)."""
    import kvpool

    out: dict[str, list[float]] = {"connect": [], "put": [], "get": []}
    opts = dict(credential=credential, data_path=path, use_shm=False, transports=["tcp"], timeout=10)
    for _ in range(connects):
        t0 = time.perf_counter()
        try:
            client = kvpool.connect(address, **opts)
            client.exists("probe")
            out["connect"].append((time.perf_counter() - t0) * 1e3)
            client.close()
        except Exception:  # noqa: BLE001 - a refused connection is what this bench counts
            out["connect"].append(float("nan"))
    value = os.urandom(size)
    buf = bytearray(size)
    with kvpool.connect(address, **opts) as client:
        for i in range(ops):
            key = f"flood/{tag}/{path}/{i}"
            for op, fn in (("put", lambda: client.put(key, value)), ("get", lambda: client.get_into(key, buf))):
                t0 = time.perf_counter()
                try:
                    fn()
                    out[op].append((time.perf_counter() - t0) * 1e3)
                except Exception:  # noqa: BLE001 - counted as failed
                    out[op].append(float("nan"))
        client.remove_batch([f"flood/{tag}/{path}/{i}" for i in range(ops)])
    return out


def _p(values: list[float], q: float) -> float:
    """Percentile `q` of the latencies that succeeded (a failure is counted apart, in `failed`)."""
    ok = [v for v in values if v == v]
    return float(np.percentile(ok, q)) if ok else float("inf")
