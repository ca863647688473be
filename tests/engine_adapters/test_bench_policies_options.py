"""`kvpool bench policies`' scenarios (issue 9), its presets: a bad size is a clear usage error before
anything starts, a run's worker counters become prefills per worker and a hit ratio, and
`kvpool sim validate` still reads the setup note (and refuses the scenario it does not model)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from kvpool.tools.bench.cluster import counter_delta
from kvpool.tools.bench.policies import PoliciesWorkload, _setup_note, policies
from kvpool.errors import InvalidArgument
from kvpool.tools.sim.profile import Profile
from kvpool.tools.sim.validate import cases
from kvpool.tools.workload_file import resolve


def test_bad_sizes_are_usage_errors_before_anything_starts(tmp_path):
    for key in ("pool_dram", "local_cache"):
        result = CliRunner().invoke(policies, ["--workload", "local-caches", "--set", f"{key}=lots", "--workdir",
                                               str(tmp_path / "never")])
        assert result.exit_code == 2 and "not a size" in result.output and repr(key) in result.output
        assert not (tmp_path / "never").exists()


def test_local_caches_scenario_shrinks_the_pool_below_the_working_set():
    shared, local = (resolve("bench policies", PoliciesWorkload, name) for name in ("shared-pool", "local-caches"))
    assert shared.settings() == PoliciesWorkload().settings()  # the default run is the shared-pool preset
    assert shared.pool_dram is None and shared.local_cache is None
    assert local.conversations % 2 == 1  # round robin over 2 prefill workers scatters conversations
    assert local.system_prompts == 0  # one system prompt per conversation: no prefix shared across them
    assert (local.pool_dram, local.local_cache, local.pool_eviction) == ("128MiB", "128MiB", "lru")


def test_counter_delta_gives_prefills_per_worker_and_the_hit_ratio():
    before = {"p0": {"prefills": 2, "local": 0, "pool": 0, "computed": 1000}, "p1": {"prefills": 1}}
    after = {"p0": {"prefills": 5, "local": 512, "pool": 0, "computed": 1300},
             "p1": {"prefills": 2, "local": 0, "pool": 256, "computed": 700}}
    delta = counter_delta(before, after)
    assert delta["prefills_by_worker"] == {"p0": 3, "p1": 1}
    assert delta["prompt_tokens_by_source"] == {"local": 512, "pool": 256, "computed": 1000}
    assert delta["hit_ratio"] == 768 / 1768


def test_sim_validate_reads_the_shared_pool_note_and_refuses_a_local_caches_run():
    slos = {"ttft": 2000.0, "tpot": 150.0}
    case = {"case": "ttft_mean/round_robin@0.5", "value": 1.0, "extra": {}}
    words = lambda messages: [len(w) for m in messages for w in m["content"].split()]  # noqa: E731
    profile = Profile("t", p0=0.0, p_tok=3e-3, d_seq=0.065, bytes_per_token=46080)
    shared = {"bench": "policies", "results": [case],
              "notes": [_setup_note("shared-pool", 2, 1, None, None, 6, 4, 600, 2, slos)]}
    built = cases(shared, words, profile)
    assert len(built) == 1 and len(built[0].workload) == 24 and built[0].config.prefill == 2
    local = {**shared, "notes": [_setup_note("local-caches", 2, 1, "128MiB", "128MiB", 7, 4, 500, 7, slos)]}
    with pytest.raises(InvalidArgument, match="local-caches"):
        cases(local, words, profile)
