"""`kvpool bench store` runs end to end and reports in the shared shape (no speed asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

from kvpool.tools.bench.store import replay_trace


def test_bench_store_json_shape(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"hash_ids": [0, i % 7, 100 + i]}) + "\n" for i in range(200)))
    out = subprocess.run(
        [sys.executable, "-c", "from kvpool.cli import main; main()", "--log-level", "WARNING", "bench", "store",
         "--json", "--reps", "1", "--working-set", "8", "--rounds", "1", "--trace", str(trace), "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=180, check=True)
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["bench"] == "store"
    cases = {(r["case"], r["size"]) for r in doc["results"]}
    for size in (64 << 10, 1 << 20, 8 << 20):
        assert {("dram_get_into", size), ("dram_put", size), ("ssd_get", size), ("ssd_put", size)} <= cases
    policies = [r for r in doc["results"] if r["case"].startswith("policy_hit_ratio_")]
    assert {r["case"] for r in policies} == {"policy_hit_ratio_s3fifo", "policy_hit_ratio_arc"}
    for r in doc["results"]:
        assert r["value"] > 0 and r["baseline_value"] > 0 and r["ratio"] > 0
    assert list(tmp_path.iterdir()) == [trace]  # the bench cleaned up its lmdb and files


def test_replay_counts_prefix_hits_only():
    # Request 2 shares block 1 but not block 0: a prefix cache cannot use it.
    assert replay_trace([[0, 1], [2, 1]], "lru", 10).hit_ratio == 0.0
    assert replay_trace([[0, 1], [0, 1, 2]], "lru", 10).hit_ratio == 2 / 5
    assert replay_trace([[0, 1], [0, 1]], "lru", 1).hit_ratio == 0.0  # too small to keep the prefix


def test_replay_counts_handoffs_the_decode_worker_lost():
    # Each request's blocks are read by its decoder one request later: with room for 6 blocks they
    # are all still there; with room for 2, the next request's writes evicted them first.
    requests = [[0, 1], [2, 3], [4, 5]]
    assert replay_trace(requests, "lru", 6, handoff_lag=1).handoffs_lost == 0.0
    assert replay_trace(requests, "lru", 2, handoff_lag=1).handoffs_lost == 1.0
    assert replay_trace(requests, "lru", 2, handoff_lag=None).handoffs_lost == 0.0  # no decode reads
