"""The event loop against hand-computed timelines, the cache against the trace's own reuse, LRU
monotone in capacity (hypothesis), and the real router policies doing the routing."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings, strategies as st

from kvpool.router.policy import CacheAware, RoundRobin
from kvpool.tools.sim.engine import SimConfig, Simulation
from kvpool.tools.sim.profile import Profile
from kvpool.tools.sim.results import summarize
from kvpool.tools.sim.workload import SimRequest, Workload, load_trace, reuse_upper_bound, synthetic

# A toy profile with round numbers: prefill 1 ms/token + 10 ms, decode 5 ms per sequence per step.
TOY = Profile("toy", p0=0.01, p_tok=1e-3, p_attn=0.0, d0=0.0, d_seq=0.005, d_kv=0.0, bytes_per_token=100,
              link_bytes_per_s=1e6, dram_read_bytes_per_s=1e9, push_bytes_per_s=1e6, rpc_s=0.001,
              prefill_chunk_tokens=512, max_batch=8)


def simulate(workload: Workload, config: SimConfig, slo_ttft_s: float, slo_tbt_s: float) -> dict:
    return summarize(Simulation(workload, config).run(), slo_ttft_s, slo_tbt_s)


def _one(req: SimRequest, **cfg) -> Simulation:
    return Simulation(Workload((req,), 512), SimConfig(profile=TOY, fit_cost=False, **cfg)).run()


def test_disaggregated_timeline_is_exact():
    sim = _one(SimRequest(0.0, 1000, 11, (1, 2)), prefill=1, decode=1, local_prefill_tokens=0)
    f = sim.flights[0]
    assert f.kind == "disaggregated"
    push = 1000 * 100 / 1e6  # all 1000 tokens are new
    prefill = 0.01 + 1e-3 * 1000
    assert f.t_first == pytest.approx(0.001 + prefill + push + 0.001)
    pull = 1000 * 100 / 1e6
    decode = 10 * 0.005  # 10 more tokens, batch of one
    assert f.t_done == pytest.approx(f.t_first + 0.001 + pull + decode + 0.001)
    assert sim.instances[0].busy_s == pytest.approx(prefill)
    assert sim.instances[1].busy_s == pytest.approx(decode)


def test_colocated_chunks_interleave_with_decode_and_stretch_tbt():
    a = SimRequest(0.0, 100, 200, (1,))
    b = SimRequest(0.2, 2048, 2, (2, 3, 4, 5))  # arrives while a decodes: four 512-token chunks
    sim = Simulation(Workload((a, b), 512), SimConfig(colocated=1, profile=TOY, fit_cost=False)).run()
    fa, fb = sim.flights
    assert fa.kind == fb.kind == "colocated"
    chunk = 0.01 + 0.512
    # b's prefill: 4 iterations, each a decode step of a (5 ms) plus one chunk
    # (one hop in, at most one decode step of waiting, one hop out)
    assert fb.t_first - fb.req.arrival_s == pytest.approx(0.001 + 4 * (0.005 + chunk) + 0.001, abs=0.0051)
    assert max(sim.tbt_values) == pytest.approx(0.005 + chunk)  # a waited behind a chunk
    # a's 199 decode tokens: 4 of them stretched by a chunk
    assert fa.t_done - fa.t_first == pytest.approx(199 * 0.005 + 4 * chunk + 0.001, abs=0.006)


def test_decode_batches_join_between_steps_and_events_do_not_scale_with_tokens():
    reqs = tuple(SimRequest(0.01 * i, 64, 5000, (100 + i,)) for i in range(8))
    sim = Simulation(Workload(reqs, 512), SimConfig(prefill=1, decode=1, profile=TOY, fit_cost=False,
                                                     local_prefill_tokens=0)).run()
    assert all(f.t_done > 0 for f in sim.flights)
    assert sim.instances[1].steps >= 4999  # every token was stepped...
    assert sim._seq < 200  # ...in a few dozen events
    # with 8 sequences sharing a step, each token takes 8 x 5 ms at full batch
    tpot = [(f.t_done - f.t_first) / 4999 for f in sim.flights]
    assert max(tpot) == pytest.approx(8 * 0.005, rel=0.05)


def test_unlimited_cache_hit_ratio_vs_trace_upper_bound(trace_path):
    w = load_trace(trace_path, limit=1500)
    upper, _ = reuse_upper_bound(w.requests, 512)
    realistic = simulate(w, SimConfig(prefill=4, decode=4, profile=TOY.__class__("t8", p0=0.01, p_tok=1e-4,
                                                                                 d_seq=1e-3)), 2.0, 0.1)
    assert realistic["hit_ratio"] <= upper + 1e-12
    assert realistic["hit_ratio"] > 0.9 * upper
    # one request at a time, so far apart that every prefill has stored its blocks before the
    # next arrives (the trace has many requests in the same millisecond): exactly the trace's own
    spaced = Workload(tuple(replace(r, arrival_s=i * 1e4) for i, r in enumerate(w.requests)), 512)
    sim = Simulation(spaced, SimConfig(prefill=4, decode=4, profile=TOY)).run()
    hits = sum(f.hit_blocks for f in sim.flights)
    assert hits / sum(len(f.req.blocks) for f in sim.flights) == pytest.approx(upper, abs=1e-12)


def test_a_block_is_usable_only_once_its_prefill_stored_it():
    # the same prompt twice, 0.1 s apart, but its prefill takes ~2 s: the second one cannot hit
    reqs = (SimRequest(0.0, 2048, 2, (1, 2, 3, 4)), SimRequest(0.1, 2048, 2, (1, 2, 3, 4)),
            SimRequest(10.0, 2048, 2, (1, 2, 3, 4)))
    sim = Simulation(Workload(reqs, 512), SimConfig(prefill=2, decode=1, profile=TOY, fit_cost=False)).run()
    assert [f.hit_blocks for f in sim.flights] == [0, 0, 4]


@st.composite
def traces(draw):
    n = draw(st.integers(5, 40))
    roots = draw(st.integers(1, 4))
    reqs = []
    for i in range(n):
        root = draw(st.integers(0, roots - 1))
        depth = draw(st.integers(1, 6))
        branch = draw(st.integers(0, 3))
        # a prefix chain: block j of a prompt is named by (root, j) for the shared part, then (i, j)
        shared = draw(st.integers(0, depth))
        blocks = tuple(root * 1000 + j if j < shared else 10**6 + (branch * 97 + i) * 100 + j for j in range(depth))
        reqs.append(SimRequest(i * 1e5, depth * 512, 2, blocks))
    return Workload(tuple(reqs), 512)


@settings(max_examples=60, deadline=None)
@given(w=traces(), small=st.integers(1, 20), extra=st.integers(1, 20))
def test_lru_hit_ratio_is_monotone_in_capacity(w, small, extra):
    block_bytes = 512 * TOY.bytes_per_token
    ratios = []
    for blocks in (small, small + extra):
        cfg = SimConfig(prefill=1, decode=1, profile=TOY, dram_bytes=blocks * block_bytes, eviction="lru")
        ratios.append(simulate(w, cfg, 1.0, 1.0)["hit_ratio"])
    assert ratios[0] <= ratios[1] + 1e-12


def test_the_real_router_policies_route():
    w = synthetic(64, 50.0, seed=1)
    rr = Simulation(w, SimConfig(prefill=4, decode=4, profile=TOY, policy="round_robin", local_prefill_tokens=0)).run()
    assert isinstance(rr.policy, RoundRobin)
    per = {}
    for f in rr.flights:
        per[f.decode_inst.name] = per.get(f.decode_inst.name, 0) + 1
    assert sorted(per.values()) == [16, 16, 16, 16]
    ca = Simulation(w, SimConfig(prefill=4, decode=4, profile=TOY, policy="cache_aware")).run()
    assert isinstance(ca.policy, CacheAware)
    assert {f.kind for f in ca.flights} <= {"disaggregated", "local_prefill"}


def test_global_pool_beats_local_caches_at_equal_capacity():
    w = synthetic(400, 4.0, system_prompts=6, seed=2)
    block_bytes = 512 * TOY.bytes_per_token
    common = dict(prefill=4, decode=4, profile=TOY, dram_bytes=80 * block_bytes, policy="cache_aware")
    glob = simulate(w, SimConfig(cache="global", **common), 10.0, 1.0)
    local = simulate(w, SimConfig(cache="local", **common), 10.0, 1.0)
    assert glob["hit_ratio"] > local["hit_ratio"]


def test_ssd_tier_catches_dram_evictions():
    w = synthetic(300, 4.0, system_prompts=8, seed=4)
    block_bytes = 512 * TOY.bytes_per_token
    dram_only = simulate(w, SimConfig(prefill=2, decode=2, profile=TOY, dram_bytes=20 * block_bytes), 10.0, 1.0)
    with_ssd = simulate(w, SimConfig(prefill=2, decode=2, profile=TOY, dram_bytes=20 * block_bytes,
                                     ssd_bytes=400 * block_bytes), 10.0, 1.0)
    assert with_ssd["hit_ratio"] > dram_only["hit_ratio"]
    assert with_ssd["traffic"]["demoted_bytes"] > 0 and with_ssd["traffic"]["ssd_read_bytes"] > 0


@pytest.mark.parametrize("cluster", [dict(prefill=2, decode=3), dict(colocated=3)])
def test_every_request_finishes_and_the_books_balance(cluster):
    w = synthetic(300, 20.0, seed=5)
    sim = Simulation(w, SimConfig(profile=TOY, dram_bytes=50 * 512 * TOY.bytes_per_token, **cluster)).run()
    assert all(f.t_done >= f.t_first > f.req.arrival_s for f in sim.flights)
    for inst in sim.instances:
        assert inst.inbound == 0 and inst.pending_tokens == 0 and not inst.queue and not inst.running
        assert inst.kv == 0 and inst.wake_at is None
    assert sim.busy_instances == 0
    assert sum(sim.tbt_weights) == sum(f.req.output_tokens - 1 for f in sim.flights)


def test_a_handed_off_sequence_lengthens_the_step_it_joins_and_only_that_one():
    """The reference worker assembles a handed-off prompt's KV chunks in the first step the
    sequence is in (`d_join_kv` per KV token): the sequence already decoding sees one longer gap;
    a sequence prefilled where it decodes joins without it."""
    join = replace(TOY, d_join_kv=1e-4)  # 1000 KV tokens: 0.1 s, 20 steps' worth
    a = SimRequest(0.0, 64, 400, (1,))
    b = SimRequest(0.5, 1000, 11, (2, 3))
    runs = {}
    for prof in (TOY, join):
        runs[prof.d_join_kv] = Simulation(Workload((a, b), 512), SimConfig(
            prefill=1, decode=1, profile=prof, fit_cost=False, local_prefill_tokens=0)).run()
    plain, joined = runs[0.0], runs[1e-4]
    assert [f.kind for f in joined.flights] == ["disaggregated"] * 2
    fa0, fa1 = plain.flights[0], joined.flights[0]
    # two hand-offs: a's own (64 tokens, alone in its batch) and b's (1000 tokens, into a's batch)
    assert fa1.t_done - fa0.t_done == pytest.approx(0.1 + 64e-4, abs=1e-9)
    assert max(joined.tbt_values) == pytest.approx(2 * 0.005 + 0.1)  # the step b joined: both sequences + join
    assert joined.instances[1].join_s == pytest.approx(0.1 + 64e-4)
    colo = Simulation(Workload((a, b), 512), SimConfig(colocated=1, profile=join, fit_cost=False)).run()
    assert colo.instances[0].join_s == 0.0  # computed where it decodes: nothing to assemble
