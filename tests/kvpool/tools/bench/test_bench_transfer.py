"""`kvpool bench transfer` runs end to end and reports in the shared shape (no speed asserted)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_transfer_json_shape():
    out = subprocess.run(
        [sys.executable, "-c", "from kvpool.cli import main; main()", "--log-level", "WARNING", "bench", "transfer",
         "--json", "--sizes", "64KiB,1MiB", "--total", "2MiB", "--reps", "1", "--latency-ops", "20",
         "--no-mooncake"],
        capture_output=True, text=True, timeout=120, check=True)
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["bench"] == "transfer"
    cases = {(r["case"], r["size"]) for r in doc["results"]}
    for size in (65536, 1048576):
        assert {("shm_read", size), ("tcp_read", size), ("tcp_write", size)} <= cases
    assert ("tcp_read_latency_p99", 65536) in cases
    for r in doc["results"]:
        assert r["value"] > 0
        if r["baseline"] is not None:
            assert r["baseline_value"] > 0 and r["ratio"] > 0
