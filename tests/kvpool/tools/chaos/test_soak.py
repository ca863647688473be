"""The soak (issue 14): the judge of "flat" on synthetic series (fast), and a short real soak
through `kvpool soak` (slow): a cluster on loopback, clients SIGKILLed mid-operation and
replaced, every server's memory, fds and threads and the pool's /dev/shm files flat.

The hour-long run is by hand (`kvpool soak --duration 3600 --out benchmarks`); its figures are
in RELIABILITY.md."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from kvpool.tools.chaos import leaks
from kvpool.tools.chaos.procs import etcd_binary

HOUR = [10.0 * i for i in range(361)]  # an hour, a sample every 10 s


def _noisy(rng: random.Random, base: float, noise: float, per_s: float = 0.0) -> list[float]:
    return [base + per_s * t + rng.uniform(-noise, noise) for t in HOUR]


def test_a_steady_fd_leak_is_judged_a_leak_and_a_noisy_flat_count_flat():
    rng = random.Random(1)
    # One fd per client departure (one every ~20 s), under the noise of 4 clients connecting.
    leak = [round(y) for y in _noisy(rng, 20, 4, per_s=1 / 20)]
    flat = [round(y) for y in _noisy(rng, 20, 4)]
    assert not leaks.judge(HOUR, leak, "fds", clients=4)["flat"]
    verdict = leaks.judge(HOUR, flat, "fds", clients=4)
    assert verdict["flat"], verdict
    assert abs(verdict["slope_per_hour"]) < verdict["allowed"]


def test_memory_that_fills_then_holds_is_flat_and_one_that_keeps_growing_is_not():
    rng = random.Random(2)
    # Warm-up: 40 MiB of tiers and caches filling in the first 20 minutes, then allocator noise.
    warm = [70 + min(t, 1200) / 30 + rng.uniform(-1.5, 1.5) for t in HOUR]
    assert leaks.judge(HOUR, warm, "rss_mib")["flat"]
    # 80 bytes per operation at 60 operations a second: 16.5 MiB an hour.
    growing = [70 + 80 * 60 * t / 2**20 + rng.uniform(-1.5, 1.5) for t in HOUR]
    verdict = leaks.judge(HOUR, growing, "rss_mib")
    assert not verdict["flat"] and "grew" in verdict["why"]
    # A single new shm file half-way through the window is a leak; a constant count is not.
    assert not leaks.judge(HOUR, [6] * 300 + [7] * 61, "shm_files")["flat"]
    assert leaks.judge(HOUR, [6] * 361, "shm_files")["flat"]
    assert not leaks.judge(HOUR[:6], [6] * 6, "shm_files")["flat"]  # too few samples to judge


def test_idle_samples_catch_what_departed_clients_left_behind():
    mid = {"n0": {"fds": 16, "threads": 8}, "n1": {"fds": 16, "threads": 8}}
    end = {"n0": {"fds": 17, "threads": 8}, "n1": {"fds": 31, "threads": 8}}
    checks = {c["process"]: c["ok"] for c in leaks.judge_idle(mid, end)}
    assert checks == {"n0": True, "n1": False}
    assert not leaks.judge_idle(mid, {"n0": end["n0"]})[1]["ok"]  # n1 gone


def test_process_samples_and_the_pools_shm_files(tmp_path):
    me = leaks.sample_process(os.getpid())
    assert me["fds"] > 2 and me["threads"] >= 1 and me["rss_mib"] >= me["anon_mib"] > 1
    for name in ("kvpool-123-0abc", "kvpool-123-0abc.idx", "kvpool-456-0abc", "other-123-0abc"):
        (tmp_path / name).touch()
    assert leaks.pool_shm_files({123}, str(tmp_path)) == ["kvpool-123-0abc", "kvpool-123-0abc.idx"]
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert leaks.sample_process(proc.pid) is None


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_short_soak_with_clients_killed_mid_operation_leaks_nothing(tmp_path):
    if etcd_binary() is None:
        pytest.skip("etcd is not installed (make system-deps)")
    out = tmp_path / "out"
    cmd = [sys.executable, "-c", "from kvpool.cli import main; main()", "--log-level", "WARNING", "soak",
           "--duration", "80", "--sample", "2", "--kill-every", "6", "--out", str(out),
           "--workdir", str(tmp_path / "work")]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=540)
    print(run.stdout[-4000:], run.stderr[-2000:])
    report = json.loads((out / "soak.json").read_text())
    assert (out / "soak.png").stat().st_size > 10_000
    t = report["totals"]
    assert run.returncode == 0 and report["ok"], report["failed"]
    assert t["killed"] - t["killed_at_once"] >= 4 and t["killed_mid_op"] >= 1, t
    assert t["ops"] > 300 and t["wrong"] == 0, t
    assert len(report["samples"]) >= 30
    assert set(report["series"]) == {"master0", "master1", "n0", "n1", "n2"}
    assert all(c["ok"] for c in report["idle_checks"]) and len(report["idle_checks"]) == 5
    assert report["shm_files"]["end"] == 6  # three nodes, an arena and an index each
