"""`kvpool bench router --json` end to end with few repetitions: both routing cases against a real
pool and the TTFT-overhead case on a real cluster, with the fields BENCHMARKS.md quotes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.model, pytest.mark.slow]


def test_router_bench_reports_routing_time_and_the_added_ttft():
    run = subprocess.run([sys.executable, "-c", "from kvpool.cli import main; main()", "bench", "router",
                          "--reps", "5", "--chunks", "2000", "--ttft-reps", "4", "--json"],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    results = {r["case"]: r for r in json.loads(run.stdout.strip().splitlines()[-1])["results"]}
    for case in ("route_cold", "route_warm"):
        extra = results[case]["extra"]
        assert results[case]["baseline"] == "tokenize_whole_text"
        assert extra["prompt_tokens"] > 7000 and extra["chunks_indexed"] == 2000
        assert 0 < extra["p50_ms"] <= extra["p99_ms"] and extra["cpu_mean_ms"] > 0
        assert extra["match_inline_calls"] + extra["match_async_calls"] == 5
        assert 0 < extra["fast_engine_whole_text_p50_ms"] < results[case]["baseline_value"]
    ttft = results["ttft_via_router"]
    assert ttft["baseline"] == "workers_called_directly" and ttft["value"] > 0 and ttft["baseline_value"] > 0
    assert {"added_p50_ms", "added_p50_ci95_ms", "added_raw_ttft_p50_ms"} <= set(ttft["extra"])
