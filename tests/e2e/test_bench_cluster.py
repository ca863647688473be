"""`kvpool bench disagg` and `kvpool bench policies` end to end, on tiny workloads: each starts its
own pool, workers and routers as processes, and its JSON must carry every row BENCHMARKS.md
quotes (the seed's table, the policy comparison) with values a real run can produce. Slow: each
starts and stops whole clusters (~1-2 minutes apiece here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from kvpool.tools.launch.processes import clean_env

pytestmark = [pytest.mark.model, pytest.mark.slow]

KVPOOL = str(Path(sys.executable).with_name("kvpool"))


def _bench(args: list[str], tmp_path: Path) -> dict:
    env = clean_env()
    r = subprocess.run([KVPOOL, "--log-level", "WARNING", "bench", *args, "--workdir", str(tmp_path), "--json"],
                       capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_bench_disagg_reports_the_seeds_table(tmp_path):
    doc = _bench(["disagg", "--config", "colocated", "--config", "disagg+conditional", "--num-requests", "4",
                  "--workload", "smoke", "--rate", "4", "--plot", str(tmp_path / "t.png")], tmp_path)
    cases = {r["case"]: r for r in doc["results"]}
    for config in ("colocated", "disagg+conditional"):
        for metric in ("ttft_mean_ms", "ttft_std_ms", "tpot_p99_ms", "itl_p99_ms", "e2e_p99_ms", "out_tok_per_s",
                       "goodput", "busy_mean"):
            assert f"{metric}/{config}@4" in cases, metric
        assert 0 < cases[f"ttft_mean_ms/{config}@4"]["value"] <= cases[f"e2e_p99_ms/{config}@4"]["value"]
        assert cases[f"itl_p99_ms/{config}@4"]["value"] > 0
        extra = cases[f"busy_mean/{config}@4"]["extra"]
        assert all(0 < b <= 1.05 for b in extra["busy"].values()), extra
        assert set(extra["cpu"]) == set(extra["busy"]) | {"router", "pool"} and extra["cpu"]["router"] > 0, extra
        assert sum(extra["decisions"].values()) == 4, extra  # every request routed once, none refused
    assert set(cases["busy_mean/colocated@4"]["extra"]["decisions"]) == {"colocated"}
    assert set(cases["busy_mean/disagg+conditional@4"]["extra"]["decisions"]) <= {"disaggregated", "local_prefill"}
    assert cases["tpot_p99_ms/disagg+conditional@4"]["baseline"] == "colocated"
    assert (tmp_path / "t.png").stat().st_size > 0
    assert doc["setup"]["split"] == [1, 1] and doc["setup"]["cpus_per_worker"] == 1


def test_bench_policies_compares_the_three_on_the_same_workers(tmp_path):
    doc = _bench(["policies", "--workload", "local-caches", "--set", "conversations=2", "--set", "rounds=2",
                  "--set", "system_len=300", "--set", "output_len=4", "--rate", "0.5"], tmp_path)
    cases = {r["case"]: r for r in doc["results"]}
    for policy in ("round_robin", "least_loaded", "cache_aware"):
        row = cases[f"ttft_mean/{policy}@0.5"]["extra"]
        assert row["completed"] == 4 and row["failed"] == 0, row["errors"]
        assert sum(row["prefills_by_worker"].values()) == 4
        # every worker is listed by the router (-1: unknown to it), its local chunks counted on both sides
        assert set(row["local_chunks_known_held"]) == set(row["prefills_by_worker"])
        assert all(known >= 0 and held >= 0 for known, held in row["local_chunks_known_held"].values()), row
    assert cases["ttft_mean/cache_aware@0.5"]["baseline"] == "best_other_policy"
    # a second round finds its system prompt's chunk cached (the worker's own cache or, when its KV
    # events had not reached the router yet, the pool); both would, but for a round that arrives
    # while its first round is still prefilling
    source = cases["ttft_mean/cache_aware@0.5"]["extra"]["prompt_tokens_by_source"]
    assert source["local"] + source["pool"] >= 256, source
