"""A soak: the chaos campaign's cluster (etcd, masters, nodes with DRAM and SSD) under a steady
put/get/match_prefix/remove load for a long time, with no faults in the servers, while the
clients come and go: some are SIGKILLed in the middle of an operation, some finish and exit
cleanly, and each is replaced at once by a new one (new keys, new connections, new mappings
of the nodes' shared-memory arenas). Every `sample_s` the servers' memory, fds and threads and
the pool's /dev/shm files are sampled; at the end `kvpool.tools.chaos.leaks` judges each series flat
or not, and two idle samples (no client connected, mid-run and at the end) must match.

    report = run_soak(Path("/tmp/soak"), duration_s=3600, seed=1)
    report["ok"]          # every verdict passed
    python -m kvpool.tools.chaos.soak --address etcd://... --client 7 --out ops-7.jsonl   # one client
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import kvpool
from kvpool.tools.chaos import leaks
from kvpool.tools.chaos.cluster import ChaosCluster
from kvpool.tools.chaos.load import Load, _name
from kvpool.errors import KVPoolError

log = logging.getLogger(__name__)

METRICS = ("rss_mib", "anon_mib", "fds", "threads")
_SLEEPING = {"hrtimer_nanosleep", "do_nanosleep", "clock_nanosleep"}  # a client between operations


class SoakLoad(Load):
    """The chaos load client, connected with or without the same-host shared-memory paths."""

    def __init__(self, *args, use_shm: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self.use_shm = use_shm

    def connect(self) -> None:
        while self.pool is None and not self.stopping:
            t0 = time.time()
            try:
                self.pool = kvpool.connect(self.address, timeout=self.timeout, use_shm=self.use_shm)
            except KVPoolError as exc:
                self.record(t0=t0, t1=time.time(), op="connect", res="err", err=_name(exc))
                time.sleep(0.2)


class Clients:
    """The load client processes: keeps `n` alive, SIGKILLs one on demand (waiting, up to 2 s,
    until it is inside an operation rather than sleeping between two), counts the departures."""

    def __init__(self, workdir: Path, address: str, seed: int, n: int, rate: float, lifetime: tuple[float, float]):
        self.workdir, self.address, self.seed, self.n, self.rate = workdir, address, seed, n, rate
        self.lifetime = lifetime
        self.rng = random.Random(seed)
        self.live: dict[int, tuple[subprocess.Popen, float]] = {}  # client id -> (process, started)
        self.paths: list[Path] = []
        self.pids: set[int] = set()
        self.next_id = 0
        self.killed = self.killed_mid_op = self.exited_clean = self.exited_badly = 0
        self.killed_at_once = 0  # of `killed`: by kill_all (the idle checks), not one by one

    def spawn(self) -> None:
        cid, self.next_id = self.next_id, self.next_id + 1
        path = self.workdir / f"ops-{cid}.jsonl"
        self.paths.append(path)
        lifetime = self.rng.uniform(*self.lifetime)
        with open(self.workdir / "clients.log", "ab") as logfile:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvpool.tools.chaos.soak", "--address", self.address, "--client", str(cid),
                 "--seed", str(self.seed * 100_000 + cid), "--out", str(path), "--rate", str(self.rate),
                 "--duration", f"{lifetime:.1f}", "--shm" if cid % 2 == 0 else "--no-shm"],
                stdout=logfile, stderr=subprocess.STDOUT)
        self.pids.add(proc.pid)
        self.live[cid] = (proc, time.monotonic())

    def refill(self) -> None:
        """Count the clients that ended by themselves and start their replacements."""
        for cid, (proc, _) in list(self.live.items()):
            code = proc.poll()
            if code is not None:
                del self.live[cid]
                if code == 0:
                    self.exited_clean += 1
                else:
                    self.exited_badly += 1
                    log.warning("soak client %d exited with %s (see clients.log)", cid, code)
        while len(self.live) < self.n:
            self.spawn()

    def kill_one(self) -> bool:
        """SIGKILL a random client that has recorded operations; True if it was mid-operation."""
        ready = [cid for cid in self.live if _size(self.workdir / f"ops-{cid}.jsonl") > 0]
        if not ready:
            return False
        cid = self.rng.choice(ready)
        proc, _ = self.live.pop(cid)
        mid_op = False
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                where = Path(f"/proc/{proc.pid}/wchan").read_text().strip()
            except OSError:
                break
            if where not in _SLEEPING:
                mid_op = True
                break
            time.sleep(0.003)
        proc.kill()
        proc.wait()
        self.killed += 1
        self.killed_mid_op += mid_op
        return mid_op

    def kill_all(self) -> None:
        for proc, _ in self.live.values():
            proc.kill()
        for proc, _ in self.live.values():
            proc.wait()
        self.killed += len(self.live)
        self.killed_at_once += len(self.live)
        self.live.clear()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


class OpCounter:
    """Operations, errors and wrong answers in the clients' records, read incrementally."""

    def __init__(self):
        self.offsets: dict[Path, int] = {}
        self.ops = self.errors = self.wrong = 0

    def update(self, paths: list[Path]) -> None:
        for path in paths:
            offset = self.offsets.get(path, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read()
            except OSError:
                continue
            data = data[:data.rfind(b"\n") + 1]  # a killed client may leave half a line
            self.offsets[path] = offset + len(data)
            self.ops += data.count(b"\n")
            self.errors += data.count(b'"res":"err"')
            self.wrong += data.count(b'"res":"wrong"') + data.count(b'"res":"bad"')


def run_soak(workdir: Path, duration_s: float = 3600.0, seed: int = 1, sample_s: float = 10.0,
             clients: int = 4, rate: float = 12.0, kill_every_s: float = 20.0,
             lifetime: tuple[float, float] = (30.0, 120.0), masters: int = 2, nodes: int = 3,
             progress: Callable[[dict, float], None] | None = None) -> dict:
    """Run the soak; returns the report (config, every sample, every verdict, `ok`)."""
    workdir.mkdir(parents=True, exist_ok=True)
    cluster = ChaosCluster(workdir, masters=masters, nodes=nodes, dram="8MiB", ssd="40MiB")
    servers = [*cluster.masters, *cluster.nodes]
    crowd = Clients(workdir, cluster.meta, seed, clients, rate, lifetime)
    counter = OpCounter()
    samples: list[dict] = []
    crashes: list[dict] = []
    idle: dict = {}  # "mid", "end": {server: sample}; "mid_t": when
    rng = random.Random(seed)
    pids: dict[str, int] = {}
    try:
        cluster.start()
        log.info("soak cluster up: etcd %s, masters %s, nodes %s", cluster.etcd.address,
                 [m.address for m in cluster.masters], [n.address for n in cluster.nodes])
        pids = {s.name: s.proc.pid for s in servers}
        t0 = time.monotonic()
        next_sample, next_kill = 0.0, kill_every_s * rng.uniform(0.5, 1.5)
        idle_at = 0.4 * duration_s  # before the judged window, so its dip is not in a series
        while (elapsed := time.monotonic() - t0) < duration_s:
            crowd.refill()
            if elapsed >= next_kill:
                crowd.kill_one()
                next_kill += kill_every_s * rng.uniform(0.5, 1.5)
            if "mid" not in idle and elapsed >= idle_at:
                crowd.kill_all()
                idle["mid"] = _idle_sample(servers)
                idle["mid_t"] = round(time.monotonic() - t0, 1)
                crowd.refill()
            if elapsed >= next_sample:
                sample = _sample(servers, pids, crowd, counter, elapsed, crashes)
                samples.append(sample)
                next_sample += sample_s
                if progress is not None:
                    progress(sample, duration_s)
            time.sleep(0.2)
        crowd.kill_all()  # the last ones go abruptly too
        idle["end"] = _idle_sample(servers)
        counter.update(crowd.paths)
        run_s = time.monotonic() - t0
    finally:
        crowd.kill_all()
        arenas = cluster.arenas() if cluster.etcd.alive else []
        cluster.stop()
    # A node stopped with SIGTERM unlinks its arena and index; a leftover is a leak (then removed).
    left = leaks.pool_shm_files(set(pids.values()) | crowd.pids)
    for path in {*arenas, *(os.path.join(leaks.SHM_DIR, n) for n in left)}:
        if os.path.exists(path):
            os.unlink(path)
    return _report(samples, pids, crowd, counter, crashes, idle, left, run_s,
                   config={"duration_s": duration_s, "seed": seed, "sample_s": sample_s, "clients": clients,
                           "rate_per_client": rate, "kill_every_s": kill_every_s, "lifetime_s": list(lifetime),
                           "masters": masters, "nodes": nodes, "dram": "8MiB", "ssd": "40MiB",
                           "cpus": os.cpu_count(), "workdir": str(workdir)})


def _sample(servers, pids: dict[str, int], crowd: Clients, counter: OpCounter, elapsed: float,
            crashes: list[dict]) -> dict:
    procs = {}
    for s in servers:
        if s.proc.pid != pids[s.name] or s.proc.poll() is not None:
            if not any(c["process"] == s.name for c in crashes):
                crashes.append({"process": s.name, "t": round(elapsed, 1), "returncode": s.proc.returncode})
            continue
        row = leaks.sample_process(s.proc.pid)
        if row is not None:
            procs[s.name] = row
    counter.update(crowd.paths)
    return {"t": round(elapsed, 1), "procs": procs,
            "shm_files": len(leaks.pool_shm_files(set(pids.values()) | crowd.pids)),
            "ops": counter.ops, "errors": counter.errors, "wrong": counter.wrong, "killed": crowd.killed,
            "killed_mid_op": crowd.killed_mid_op, "clean_exits": crowd.exited_clean,
            "bad_exits": crowd.exited_badly, "clients_started": crowd.next_id, "load1": os.getloadavg()[0]}


def _idle_sample(servers, settle_s: float = 15.0) -> dict[str, dict]:
    """The servers with no client connected: sampled once a second until two samples in a row
    agree on fds and threads (the servers have closed what the departed clients left), at most
    `settle_s`."""
    last: dict[str, dict] = {}
    deadline = time.monotonic() + settle_s
    while True:
        time.sleep(1.0)
        now = {s.name: row for s in servers if (row := leaks.sample_process(s.proc.pid)) is not None}
        same = last and all(now.get(k, {}).get(m) == v.get(m) for k, v in last.items() for m in ("fds", "threads"))
        if same or time.monotonic() > deadline:
            return now
        last = now


def _report(samples, pids, crowd, counter, crashes, idle, left, run_s, config) -> dict:
    ts = [s["t"] for s in samples]
    series: dict[str, dict] = {}
    failed: list[str] = []
    for name in pids:
        series[name] = {}
        for metric in METRICS:
            pts = [(s["t"], s["procs"][name][metric]) for s in samples if name in s["procs"]]
            v = leaks.judge([t for t, _ in pts], [y for _, y in pts], metric, clients=crowd.n)
            series[name][metric] = v
            if not v["flat"]:
                failed.append(f"{name} {metric}: {v['why']}")
    shm = leaks.judge(ts, [s["shm_files"] for s in samples], "shm_files")
    if not shm["flat"]:
        failed.append(f"/dev/shm files: {shm['why']}")
    idle_checks = leaks.judge_idle(idle.get("mid", {}), idle.get("end", {})) if "mid" in idle else []
    failed += [f"{c['process']}: {c['why']}" for c in idle_checks if not c["ok"]]
    if "mid" not in idle:
        failed.append("no idle sample mid-run (run too short)")
    failed += [f"{c['process']} died (exit {c['returncode']}) at {c['t']}s" for c in crashes]
    if left:
        failed.append(f"{len(left)} pool files left in /dev/shm after the cluster stopped: {left[:4]}")
    if counter.wrong:
        failed.append(f"{counter.wrong} wrong answers")
    totals = {"ops": counter.ops, "errors": counter.errors, "wrong": counter.wrong, "killed": crowd.killed,
              "killed_mid_op": crowd.killed_mid_op, "killed_at_once": crowd.killed_at_once,
              "clean_exits": crowd.exited_clean, "bad_exits": crowd.exited_badly, "clients_started": crowd.next_id}
    return {"ok": not failed, "failed": failed, "run_s": round(run_s, 1), "config": config, "totals": totals,
            "series": series, "shm_files": shm, "idle": idle, "idle_checks": idle_checks, "crashes": crashes,
            "shm_left_after_stop": left, "server_pids": pids, "samples": samples}


def summary(r: dict) -> str:
    t = r["totals"]
    lines = [f"soak {r['run_s']:.0f}s, seed {r['config']['seed']}: {t['ops']} operations, {t['errors']} errors, "
             f"{t['wrong']} wrong; {t['clients_started']} clients started, {t['killed']} SIGKILLed "
             f"({t['killed_mid_op']} mid-operation, {t['killed_at_once']} all at once for the idle checks), "
             f"{t['clean_exits']} exited cleanly",
             f"{'process':<10}{'metric':<10}{'start':>9}{'warm':>9}{'end':>9}{'rise':>9}{'slope/h':>10}"
             f"{'allowed':>9}  verdict"]
    rows = [(name, m, v) for name, per in r["series"].items() for m, v in per.items()]
    rows.append(("all", "shm_files", r["shm_files"]))
    for name, metric, v in rows:
        if "start" not in v:
            lines.append(f"{name:<10}{metric:<10}  {v['why']}")
            continue
        lines.append(f"{name:<10}{metric:<10}{v['start']:>9.1f}{v['warm']:>9.1f}{v['end']:>9.1f}{v['rise']:>9.2f}"
                     f"{v['slope_per_hour']:>10.2f}{v['allowed']:>9.2f}  {'flat' if v['flat'] else 'GROWS'}")
    for c in r["idle_checks"]:
        if "fds" in c:
            lines.append(f"idle {c['process']}: fds {c['fds'][0]}->{c['fds'][1]}, "
                         f"threads {c['threads'][0]}->{c['threads'][1]} {'ok' if c['ok'] else 'LEAK'}")
    lines.append("verdict: " + ("flat, nothing leaked" if r["ok"] else "FAILED: " + "; ".join(r["failed"])))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """One soak client (started by `Clients`): the chaos load for `--duration` seconds, then a clean exit."""
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--address", required=True)
    p.add_argument("--client", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--rate", type=float, default=12.0, help="operations per second")
    p.add_argument("--shm", action=argparse.BooleanOptionalAction, default=True,
                   help="take the same-host shared-memory paths")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with open(a.out, "a", buffering=1 << 16) as out:
        load = SoakLoad(a.address, a.client, a.seed, out, 200, a.rate, 5.0, use_shm=a.shm)

        def stop(*_: object) -> None:
            load.stopping = True

        signal.signal(signal.SIGTERM, stop)
        load.run(time.time() + a.duration)


if __name__ == "__main__":
    main(sys.argv[1:])
