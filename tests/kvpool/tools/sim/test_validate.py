"""`kvpool sim validate` rebuilds recorded bench runs: same requests, same arrival times."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest

from kvpool.tools.bench.serve_client import poisson_offsets
from kvpool.errors import InvalidArgument
from kvpool.tools.sim.engine import Simulation
from kvpool.tools.sim.profile import Profile
from kvpool.tools.sim.results import summarize
from kvpool.tools.sim.validate import cases, compare

BENCH = Path(__file__).resolve().parents[4] / "benchmarks"
PROFILE = Profile("t", p0=0.0, p_tok=3e-3, d_seq=0.065, bytes_per_token=46080)


def _words(messages):  # a stand-in tokenizer: one id per word (the CLI uses the model's own)
    return [zlib.crc32(w.encode()) % 40000 for m in messages for w in m["content"].split()]


def test_policies_run_is_rebuilt_with_its_arrivals_and_shared_prefixes():
    doc = json.loads((BENCH / "policies-2026-12-01T0233Z.json").read_text())
    built = cases(doc, _words, PROFILE, host_cores=2)
    assert [(c.label, c.rate) for c in built][:3] == [("round_robin", 0.5), ("least_loaded", 0.5),
                                                      ("cache_aware", 0.5)]
    first = built[0]
    assert len(first.workload) == 24 and first.config.prefill == 2 and first.config.decode == 1
    assert [r.arrival_s for r in first.workload.requests] == sorted(poisson_offsets(24, 0.5, seed=500))
    row = compare(first, summarize(Simulation(first.workload, first.config).run(), 3600, 3600))
    assert row["real"]["ttft_mean_ms"] == pytest.approx(1387.158, abs=0.01)
    assert row["sim"]["mean_cached_tokens"] > 0  # shared system prompts and earlier turns hit


def test_disagg_run_is_rebuilt_from_its_setup_and_other_documents_are_refused():
    setup = {"engine": "reference", "workers": 3, "split": [1, 2], "cpus_per_worker": 1, "workload": "mixed",
             "long_fraction": 0.3, "long_len": 1500, "short_len": 150, "output_len": 64, "range_ratio": 0.1,
             "num_requests": 12, "rates": [0.2, 0.4], "chunk_tokens": 128, "slos_ms": {}}
    results = [{"case": f"{m}/{c}@{r:g}", "value": 100.0} for m in ("ttft_mean_ms", "tpot_p99_ms")
               for c in ("colocated", "disaggregated", "disagg+conditional") for r in setup["rates"]]
    doc = {"bench": "disagg", "results": results, "setup": setup}
    built = cases(doc, _words, PROFILE, host_cores=2)
    assert len(built) == 6 and {c.label for c in built} == {"colocated", "disaggregated", "disagg+conditional"}
    colo = next(c for c in built if c.label == "colocated")
    assert colo.config.colocated == 3 and colo.config.local_prefill_tokens == 0
    assert colo.config.profile.prefill_chunk_tokens == 128 and colo.config.host_cores == 0  # pinned: not shared
    dis = next(c for c in built if c.label == "disagg+conditional")
    assert (dis.config.prefill, dis.config.decode, dis.config.local_prefill_tokens) == (1, 2, 256)
    long = [r for r in colo.workload.requests if r.prompt_tokens > 1000]
    assert len(colo.workload) == 12 and 0 < len(long) < 12  # the mixed workload, as the bench drew it
    with pytest.raises(InvalidArgument, match="setup"):
        cases({"bench": "disagg", "results": results}, _words, PROFILE)
    with pytest.raises(InvalidArgument, match="reference engine"):
        cases({**doc, "setup": {**setup, "engine": "vllm"}}, _words, PROFILE)
    with pytest.raises(InvalidArgument):
        cases({"bench": "store"}, _words, PROFILE)
