"""`kvpool sim` as a user runs it: the JSON last line, plan with its PNG, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvpool.tools.sim.goodput import goodput_search

KVPOOL = [sys.executable, "-c", "from kvpool.cli import main; main()"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*KVPOOL, "sim", *args], capture_output=True, text=True, timeout=120)


def test_sim_json_last_line_has_the_issue_keys(trace_path, tmp_path):
    png = tmp_path / "run.png"
    res = _run("--trace", str(trace_path), "--set", "limit=400", "--prefill", "2", "--decode", "2", "--dram", "64GiB",
               "--set", "goodput_steps=3", "--plot", str(png), "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    for key in ("requests", "hit_ratio", "token_hit_ratio", "ttft_ms", "tbt_ms", "slo_attainment", "goodput_rps"):
        assert key in doc
    assert doc["requests"] == 400
    assert set(doc["ttft_ms"]) >= {"p50", "p99"} and set(doc["tbt_ms"]) >= {"p50", "p99"}
    assert 0 < doc["hit_ratio"] <= doc["reuse_upper_bound"]["hit_ratio"]
    assert len(doc["goodput_search"]) == 4
    assert png.stat().st_size > 10_000


def test_plan_picks_the_cheapest_passing_config_and_draws_it(tmp_path):
    png = tmp_path / "plan.png"
    res = _run("plan", "--set", "synthetic=300", "--set", "synthetic_rate=3", "--mix", "1P/1D,2P/2D,4P/4D",
               "--dram", "16GiB,unlimited", "--set", "slo_ttft_ms=5000", "--set", "slo_tbt_ms=200", "--plot", str(png),
               "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(doc["rows"]) == 6
    best = doc["cheapest"]
    passing = [r for r in doc["rows"] if r["slo_attainment"] >= 0.9 and r["dram_bytes"] is not None]
    assert best == min(passing, key=lambda r: (r["cost_per_hour"], -r["slo_attainment"]))
    assert png.stat().st_size > 10_000


@pytest.mark.parametrize("args, message", [
    (("--trace", "/no/such/trace.jsonl", "--prefill", "1", "--decode", "1"), "trace file not found"),
    (("--set", "synthetic=10", "--colocated", "2", "--prefill", "1"), "not both"),
    (("--set", "synthetic=10", "--prefill", "1", "--decode", "1", "--profile", "tpu-v9"), "unknown profile"),
    (("--set", "synthetic=10", "--prefill", "1", "--decode", "1", "--dram", "lots"), "not a size"),
    (("--set", "synthetic=10", "--prefill", "1", "--set", "polcy=round_robin"), "unknown key 'polcy'"),
    (("--prefill", "1", "--decode", "1"), "give a workload"),
])
def test_bad_input_is_a_clear_error_not_a_traceback(args, message):
    res = _run(*args)
    assert res.returncode != 0
    assert message in res.stderr
    assert "Traceback" not in res.stderr


def test_goodput_search_brackets_a_monotone_threshold():
    calls = []

    def run(scale: float) -> dict:
        calls.append(scale)
        return {"slo_attainment": 1.0 if scale * 10 <= 37 else 0.5}

    goodput, points = goodput_search(run, base_rate=10.0, target=0.9, steps=8)
    assert 30 <= goodput <= 37
    assert len(points) == 8
    none, _ = goodput_search(lambda s: {"slo_attainment": 0.0}, 1.0, 0.9, steps=3)
    assert none is None


def test_goodput_search_starts_from_known_points():
    calls = []

    def run(scale: float) -> dict:
        calls.append(scale)
        return {"slo_attainment": 1.0 if scale <= 11 else 0.0}

    goodput, points = goodput_search(run, 1.0, 0.9, steps=5, known={1.0: 1.0, 4.0: 1.0, 8.0: 1.0})
    assert calls[0] == 16.0 and len(calls) == 5
    assert 10 <= goodput <= 11
    assert len(points) == 8
