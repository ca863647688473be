"""A chaos campaign: start the cluster, run the load clients and the fault lanes for `duration_s`
(longer if `min_faults` are not injected yet), heal, read every key back, check.

    report = run_campaign(Path("/tmp/chaos"), seed=1, duration_s=600, min_faults=100)
    report["violations"]   # [] when every promise in kvpool.tools.chaos.checker held

A log line every `progress_s` says how far it is (time, faults, operations, load average).

Across namespaces (`netns=True`, root only): this process builds a `kvpool.tools.netns.Fabric`
(a namespace for etcd, each master, each node, each load client, and one for the campaign's
own probes and checks, "observer"), runs the campaign in a child process inside "observer"
(`python -m kvpool.tools.chaos.campaign`), and tears the fabric down after, whatever happened
in it; every fault is then a partition (`kvpool.tools.chaos.faults`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import kvpool
from kvpool.tools.chaos.checker import RECOVER_BOUND_S, SERVE_BOUND_S, check, read_ops
from kvpool.tools.chaos.cluster import ChaosCluster, netns_members
from kvpool.tools.chaos.faults import lanes
from kvpool.tools.chaos.values import value_of
from kvpool.tools.launch.processes import follow, spawn
from kvpool.tools.netns import Fabric
from kvpool.errors import KVPoolError

log = logging.getLogger(__name__)


def run_campaign(workdir: Path, seed: int = 1, duration_s: float = 600.0, min_faults: int = 100,
                 clients: int = 4, rate: float = 25.0, progress_s: float = 15.0, netns: bool = False) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    if netns:
        return _across_namespaces(workdir, seed, duration_s, min_faults, clients, rate, progress_s)
    return _run(workdir, seed, duration_s, min_faults, clients, rate, progress_s, None)


def _across_namespaces(workdir: Path, seed: int, duration_s: float, min_faults: int, clients: int, rate: float,
                       progress_s: float) -> dict:
    """Build the fabric, run the campaign inside its "observer" member, tear the fabric down."""
    report_path = workdir / "report-inside.json"
    log_path = workdir / "campaign.log"
    with Fabric(netns_members(clients=clients), log_dir=workdir).start() as net:
        log.info("namespace fabric %s: %s", net.tag, {m.name: m.ip for m in net.members.values()})
        argv = [sys.executable, "-m", "kvpool.tools.chaos.campaign", "--workdir", str(workdir), "--seed", str(seed),
                "--duration", str(duration_s), "--min-faults", str(min_faults), "--clients", str(clients),
                "--rate", str(rate), "--progress", str(progress_s), "--fabric", net.describe(),
                "--report", str(report_path)]
        inside = net.spawn("observer", argv, log_path)
        follow(inside, log_path)
        members = {m.name: m.ip for m in net.members.values()}
    if inside.returncode != 0 or not report_path.exists():
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"the campaign inside the namespaces failed (exit {inside.returncode}): ...{tail}")
    report = json.loads(report_path.read_text())
    report["netns"] = {"members": members, "links": "veth pairs into one bridge, nft cuts in each namespace"}
    return report


def _run(workdir: Path, seed: int, duration_s: float, min_faults: int, clients: int, rate: float,
         progress_s: float, fabric: Fabric | None) -> dict:
    cluster = ChaosCluster(workdir, fabric=fabric)
    if fabric is not None:  # this process speaks to the pool as the keyring's `chaos` admin
        os.environ.update(cluster.client_env)
    loads: list[subprocess.Popen] = []
    load_avg: list[float] = []
    counters: list[tuple[str, dict]] = []  # (leader address, its counters), one per progress line
    started = time.time()
    try:
        cluster.start()
        log.info("cluster up: etcd %s, masters %s, nodes %s; %s", cluster.etcd.address,
                 [m.address for m in cluster.masters], [n.address for n in cluster.nodes], cluster.disk_note)
        paths = [workdir / f"ops-{i}.jsonl" for i in range(clients)]
        for i, path in enumerate(paths):
            argv = [sys.executable, "-m", "kvpool.tools.chaos.load", "--client", str(i), "--seed", str(seed * 1000 + i),
                    "--out", str(path), "--rate", str(rate)]
            if fabric is None:
                # Half the clients find the leader in etcd, half go through the leader proxy by address.
                address = f"etcd://{cluster.client_etcd.address}" if i % 2 == 0 else cluster.leader_proxy.address
                loads.append(spawn([*argv, "--address", address], workdir / f"client-{i}.log", append=True))
            else:  # each client in its own namespace, finding the leader in etcd
                loads.append(fabric.spawn(f"c{i}", [*argv, "--address", cluster.meta], workdir / f"client-{i}.log",
                                          env={**os.environ, **cluster.client_env}, append=True))
        time.sleep(5)  # let the working set build before the first fault
        t_start = time.time()
        fault_lanes = lanes(cluster, seed)

        def keep_going() -> bool:
            elapsed = time.time() - t_start
            injected = sum(len(lane.faults) for lane in fault_lanes)
            return elapsed < duration_s or (injected < min_faults and elapsed < 3 * duration_s)

        threads = [threading.Thread(target=lane.run, args=(keep_going,), name=f"lane-{lane.name}", daemon=True)
                   for lane in fault_lanes]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            for t in threads:
                t.join(timeout=progress_s / len(threads))
            load_avg.append(os.getloadavg()[0])
            _sample_counters(cluster, counters)
            injected = sum(len(lane.faults) for lane in fault_lanes)
            log.info("chaos %5.0fs/%.0fs: %d faults injected, %d operations, load average %.1f",
                     time.time() - t_start, duration_s, injected, _count_lines(paths), load_avg[-1])
        t_end = time.time()
        for p in loads:
            p.terminate()
        for p in loads:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        ops = read_ops(paths)
        faults = [f.as_dict() for lane in fault_lanes for f in lane.faults]
        crashes = [vars(c) for lane in fault_lanes for c in lane.crashes]
        cluster.wait_nodes([n.name for n in cluster.nodes], 60)
        time.sleep(3 * cluster.heartbeat_s)
        sweep, sweep_t = _sweep(cluster, ops)
        _sample_counters(cluster, counters)
        result = check(ops, faults, crashes, sweep, sweep_t, _evictions(counters))
        result.update(seed=seed, duration_s=round(t_end - t_start, 1), faults=faults, crashes=crashes,
                      fault_summary=_fault_summary(faults), clients=clients, rate_per_client=rate,
                      load_average={"min": min(load_avg, default=0), "mean": round(statistics.fmean(load_avg), 2)
                                    if load_avg else 0, "max": max(load_avg, default=0)},
                      cpus=os.cpu_count(), disk=cluster.disk_note, bounds={"serve_s": SERVE_BOUND_S,
                                                                           "recover_s": RECOVER_BOUND_S},
                      workdir=str(workdir), wall_s=round(time.time() - started, 1))
        return result
    finally:
        for p in loads:
            if p.poll() is None:
                p.kill()
        arenas = cluster.arenas() if cluster.etcd.alive else []
        cluster.stop()
        for path in arenas:
            if os.path.exists(path):
                os.unlink(path)


def _sample_counters(cluster: ChaosCluster, counters: list[tuple[str, dict]]) -> None:
    try:
        with kvpool.connect(cluster.meta, timeout=3, use_shm=False) as pool:
            stats = pool.admin("stats")
        counters.append((stats["leader_address"], stats["counters"]))
    except (KVPoolError, KeyError):
        pass


def _evictions(counters: list[tuple[str, dict]]) -> int | None:
    """Evictions the masters counted: a leader's counters start at 0 when it takes over, so sum
    the last sample of each run of one leader (a lower bound: a term never sampled is missed)."""
    if not counters:
        return None
    total = 0
    for i, (leader, c) in enumerate(counters):
        following = counters[i + 1] if i + 1 < len(counters) else None
        if following is None or following[0] != leader or following[1].get("evictions", 0) < c.get("evictions", 0):
            total += int(c.get("evictions", 0))
    return total


def _sweep(cluster: ChaosCluster, ops: list[dict]) -> tuple[dict[str, str], float]:
    """Read back every acknowledged key that no client tried to remove."""
    removed = {op["key"] for op in ops if op["op"] == "remove"}
    keys = sorted({op["key"] for op in ops if op["op"] == "put" and op["res"] == "ok"} - removed)
    out: dict[str, str] = {}
    t = time.time()
    with kvpool.connect(cluster.meta, timeout=15, use_shm=False) as pool:
        for i in range(0, len(keys), 100):
            batch = keys[i:i + 100]
            try:
                values = pool.get_batch(batch)
            except KVPoolError:
                values = [pool_get_one(pool, k) for k in batch]
            for k, v in zip(batch, values):
                out[k] = v if isinstance(v, str) else "miss" if v is None else "ok" if v == value_of(k) else "wrong"
    return out, t


def pool_get_one(pool, key: str) -> bytes | None | str:
    try:
        return pool.get(key)
    except KVPoolError:
        return "err"


def _count_lines(paths: list[Path]) -> int:
    n = 0
    for p in paths:
        try:
            with open(p, "rb") as f:
                n += sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
        except OSError:
            pass
    return n


def _fault_summary(faults: list[dict]) -> dict:
    """Per kind: count, and p50/max of serve_s and recover_s."""
    out: dict[str, dict] = {}
    for kind in sorted({f["kind"] for f in faults}):
        fs = [f for f in faults if f["kind"] == kind]
        row: dict = {"count": len(fs)}
        for field in ("serve_s", "recover_s"):
            xs = sorted(f[field] for f in fs if f[field] is not None)
            row[field] = {"p50": round(statistics.median(xs), 2) if xs else None, "max": xs[-1] if xs else None,
                          "never": len(fs) - len(xs)}
        out[kind] = row
    return out


def main(argv: list[str] | None = None) -> None:
    """The campaign inside a fabric's "observer" namespace (what `run_campaign(netns=True)` starts)."""
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--duration", type=float, default=600.0)
    p.add_argument("--min-faults", type=int, default=100)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--rate", type=float, default=25.0)
    p.add_argument("--progress", type=float, default=15.0)
    p.add_argument("--fabric", required=True, help="Fabric.describe() of the fabric this runs in")
    p.add_argument("--report", type=Path, required=True)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    report = _run(a.workdir, a.seed, a.duration, a.min_faults, a.clients, a.rate, a.progress,
                  Fabric.attach(a.fabric))
    a.report.write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main(sys.argv[1:])
