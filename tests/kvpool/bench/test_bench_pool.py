"""`kvpool bench pool` runs end to end (tiny sizes) and ends with the shared JSON shape.
Speed is not asserted here; only that every system was measured and correctness held."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_bench_pool_smoke():
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
    r = subprocess.run(
        [str(Path(sys.executable).with_name("kvpool")), "bench", "pool", "--json", "--reps", "1", "--sizes", "64KiB",
         "--bytes-per-rep", "512KiB", "--min-ops", "4", "--batch", "4", "--peers", "redis"],
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
