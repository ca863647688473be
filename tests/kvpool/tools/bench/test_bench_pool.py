"""`kvpool bench pool` runs end to end (tiny sizes) and ends with the shared JSON shape.
Speed is not asserted here; only that every system was measured and correctness held."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from kvpool.tools.launch.processes import clean_env

import pytest


def test_bench_pool_smoke():
    env = clean_env()
    r = subprocess.run(
        [str(Path(sys.executable).with_name("kvpool")), "bench", "pool", "--json", "--reps", "1", "--sizes", "64KiB",
         "--set", "bytes_per_rep=512KiB", "--set", "min_ops=4", "--set", "batch=4", "--peers", "redis"],
        capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert doc["bench"] == "pool" and doc["machine"]["cpus"] >= 1
    cases = {(x["case"], x["baseline"]) for x in doc["results"]}
    assert {("get_tcp", "redis"), ("get_shm", "redis"), ("get_batch_tcp", "redis"), ("put_tcp", "redis")} <= cases
    for x in doc["results"]:
        assert x["unit"] == "GB/s" and x["size"] == 64 << 10 and x["value"] > 0
        assert x["ratio"] == round(x["value"] / x["baseline_value"], 3) or abs(
            x["ratio"] - x["value"] / x["baseline_value"]) < 0.01 * x["ratio"] + 1e-3
        assert x["extra"]["ops_per_s"] > 0


def test_twins_run_side_by_side_in_alternating_order():
    """A twin (+auth, +control) runs right next to its counterpart, after it on even turns and
    before it on odd ones, so the per-turn ratio compares two runs of the same moment."""
    from types import SimpleNamespace

    from kvpool.tools.bench.pool import _order

    systems = [SimpleNamespace(name=n) for n in
               ("ours_tcp", "ours_shm", "ours_tcp+auth", "ours_shm+auth", "ours_tcp+control", "redis")]
    names = [[s.name for s in _order(systems, rep)] for rep in (0, 1, 2)]
    assert names[0] == ["ours_tcp", "ours_tcp+auth", "ours_tcp+control", "ours_shm", "ours_shm+auth", "redis"]
    assert names[1] == ["ours_tcp+control", "ours_tcp+auth", "ours_tcp", "ours_shm+auth", "ours_shm", "redis"]
    assert names[2] == names[0]
    alone = [SimpleNamespace(name="ours_shm+auth"), SimpleNamespace(name="redis")]  # no counterpart: kept
    assert [s.name for s in _order(alone, 1)] == ["ours_shm+auth", "redis"]


def test_bench_pool_auth_is_paired_with_a_control_and_cpu_per_op():
    env = clean_env()
    r = subprocess.run(
        [str(Path(sys.executable).with_name("kvpool")), "bench", "pool", "--workload", "auth", "--json", "--reps", "2",
         "--sizes", "64KiB", "--set", "bytes_per_rep=512KiB", "--set", "min_ops=4", "--set", "batch=4",
         "--peers", "redis", "--set", "engine=false"],
        capture_output=True, text=True, timeout=400, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    rows = {(x["case"], x["baseline"]): x for x in doc["results"]}
    for case, base in (("put_tcp+auth", "ours_tcp"), ("get_tcp+auth", "ours_tcp"), ("put_shm+auth", "ours_shm"),
                       ("put_tcp+control", "ours_tcp")):
        x = rows[(case, base)]["extra"]
        low, high = x["per_turn_ratio_spread"]
        assert low <= rows[(case, base)]["ratio"] <= high  # the median of the per-turn ratios
        assert x["ratio_of_medians"] > 0
        assert x["client_cpu_us"] > 0 and x["baseline_client_cpu_us"] > 0
        assert x["server_cpu_us"] > 0 and x["baseline_server_cpu_us"] > 0
    assert any(n.startswith("auth cost put_tcp+auth") for n in doc["notes"])
    assert any(n.startswith("control put_tcp+control") for n in doc["notes"])


@pytest.mark.slow  # the RPC pairing is in the default suite (test_bench_pool_auth_is_paired...)
def test_bench_pool_auth_covers_the_engine_path_with_grants():
    """The auth preset with the engine path: the engine path of the pool with a keyring (a grant per op,
    each frame counted under its grant) is compared with the engine path without."""
    env = clean_env()
    r = subprocess.run(
        [str(Path(sys.executable).with_name("kvpool")), "bench", "pool", "--workload", "auth", "--json", "--reps", "1",
         "--sizes", "64KiB", "--set", "bytes_per_rep=256KiB", "--set", "min_ops=4", "--set", "batch=4", "--peers", "",
         "--set", "put=false"],
        capture_output=True, text=True, timeout=400, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    rows = {(x["case"], x["baseline"]): x for x in doc["results"]}
    x = rows[("get_tcp-engine+auth", "ours_tcp-engine")]["extra"]
    assert x["server_cpu_us"] > 0 and x["baseline_server_cpu_us"] > 0
    assert any(n.startswith("auth cost get_tcp-engine+auth") for n in doc["notes"])


def test_bench_pool_many_clients_measures_every_system_at_every_count():
    """Key `clients`: each count of client processes reads checked values from ours (TCP, TCP to a
    node with read workers (the preset's key `readers`), same-host) and Redis; a wrong value would
    fail the run (each get is checked in the client)."""
    env = clean_env()
    r = subprocess.run(
        [str(Path(sys.executable).with_name("kvpool")), "bench", "pool", "--workload", "many-clients", "--json",
         "--set", "clients=1,3", "--reps", "1", "--sizes", "64KiB", "--set", "duration=0.3", "--peers", "redis"],
        capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    rows = {(x["case"], x["baseline"]): x for x in doc["results"]}
    for count in (1, 3):
        for path in ("tcp", "tcp+readers", "shm"):
            x = rows[(f"get_{path}_clients_{count}", "redis")]
            assert x["unit"] == "ops/s" and x["value"] > 0 and x["baseline_value"] > 0
            assert x["extra"]["clients"] == count
            assert 0 < x["extra"]["p50_us"] <= x["extra"]["p99_us"]
            assert 0 < x["extra"]["redis_p50_us"] <= x["extra"]["redis_p99_us"]
            # the servers' own CPU over the turn: every get costs the server some, and it had some core
            assert x["extra"]["server_cpu_us_per_get"] > 0 and x["extra"]["redis_server_cpu_us_per_get"] > 0
            assert 0 < x["extra"]["server_cores"] <= (os.cpu_count() or 1)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs: one for the servers, one for the clients")
def test_bench_pool_many_clients_pins_servers_and_clients_apart():
    """Keys `server_cpus` / `client_cpus`: every server process ends up allowed only its CPUs (as
    the kernel reads it back), and the clients still read checked values."""
    server, client = sorted(os.sched_getaffinity(0))[:2]
    kvpool_bin = str(Path(sys.executable).with_name("kvpool"))
    r = subprocess.run(
        [kvpool_bin, "bench", "pool", "--workload", "many-clients", "--json", "--set", "clients=2", "--reps", "1",
         "--sizes", "64KiB", "--set", "duration=0.3", "--peers", "", "--set", "readers=false",
         "--set", f"server_cpus={server}", "--set", f"client_cpus={client}"],
        capture_output=True, text=True, timeout=300, env=clean_env())
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert f"servers pinned: tcp on CPUs {server}, shm on CPUs {server}" in doc["notes"]
    assert f"client processes pinned to CPUs {client}" in doc["notes"]
    assert {x["case"] for x in doc["results"]} == {"get_tcp_clients_2", "get_shm_clients_2"}
    bad = subprocess.run([kvpool_bin, "bench", "pool", "-w", "many-clients", "--set", "server_cpus=0-4095"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "names cores this process cannot use" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_bench_pool_refuses_bad_client_counts():
    r = subprocess.run([str(Path(sys.executable).with_name("kvpool")), "bench", "pool", "--set", "clients=0,x"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "'clients'" in r.stderr and "Traceback" not in r.stderr
