"""`kvpool bench adapter --json` end to end on a short prompt: the floor case, the ratio to it, and
the codec column (int8 over TCP vs none) are in its JSON line with the fields BENCHMARKS.md quotes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.model, pytest.mark.slow]


def test_adapter_bench_reports_the_floor_and_the_codec_column():
    run = subprocess.run([sys.executable, "-c", "from kvpool.cli import main; main()", "bench", "adapter",
                          "--tokens", "512", "--reps", "1", "--json"], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    results = {r["case"]: r for r in json.loads(run.stdout.strip().splitlines()[-1])["results"]}
    floor = results["ttft_floor_90"]
    assert floor["baseline"] == "ttft_cold" and floor["extra"]["cached_tokens"] == 256
    vs = results["ttft_cached_90_vs_floor"]
    assert vs["baseline"] == "ttft_floor_90" and vs["extra"]["x_floor"] > 0
    assert {"fetch_ms", "compute_ms", "push_ms"} <= set(vs["extra"])
    codec = results["ttft_tcp_cached_90_int8"]
    assert codec["baseline"] == "ttft_tcp_cached_90_none" and codec["extra"]["cached_tokens"] == 256
    assert 0.25 <= codec["extra"]["chunk_bytes_vs_none"] <= 0.26  # int8 of float32 KV, with its scales
