"""Routing policies are pure functions of (request, snapshot): the decisions the issue asks for,
checked on hand-built snapshots; and the online cost model recovers known coefficients."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.router.cost import CostModel, CostParams
from kvpool.router.policy import (POLICIES, CacheAware, LeastLoaded, RoundRobin, RouteRequest, Snapshot, Targets,
                                  WorkerView, cached_tokens, make_policy, prefill_estimate, tbt_estimate,
                                  without_workers)

COST = CostParams(prefill_fixed_s=0.01, prefill_token_s=1e-3, prefill_attn_s=0.0, fetch_bytes_per_s=1e9,
                  decode_token_s=0.01, handoff_s=0.005)


def req(prompt=2048, pool=0, seq=0, chunk=256):
    return RouteRequest(seq=seq, prompt_tokens=prompt, max_tokens=16, chunk_tokens=chunk,
                        pool_prefix_chunks=pool, bytes_per_token=23040)


def snap(*workers, targets=Targets()):
    return Snapshot(tuple(workers), COST, targets)


P1, P2 = WorkerView("p1", "prefill"), WorkerView("p2", "prefill")
D1, D2 = WorkerView("d1", "decode"), WorkerView("d2", "decode")


def test_cache_aware_prefers_the_worker_holding_the_prefix_locally():
    warm = WorkerView("p2", "prefill", local_prefix_chunks=7)
    d = CacheAware().choose(req(prompt=2048, pool=7), snap(P1, warm, D1))
    assert d.prefill == "p2" and d.decode == "d1" and d.kind == "disaggregated"
    assert d.cached_tokens == 7 * 256
    # p1 would have to fetch 7 chunks from the pool: more estimated time than p2's local hit.
    assert prefill_estimate(req(pool=7), P1, COST) > prefill_estimate(req(pool=7), warm, COST)


def test_cache_aware_weighs_queue_against_cache():
    warm_but_busy = WorkerView("p2", "prefill", local_prefix_chunks=4, queue_tokens=20_000)
    d = CacheAware().choose(req(prompt=2048, pool=0), snap(P1, warm_but_busy, D1))
    assert d.prefill == "p1"  # 20k queued tokens cost more than recomputing 1k


def test_decode_is_least_loaded_meeting_the_tbt_target():
    busy = WorkerView("d1", "decode", active_sequences=9)
    idle = WorkerView("d2", "decode", active_sequences=2)
    d = CacheAware().choose(req(), snap(P1, busy, idle, targets=Targets(tbt_s=0.05)))
    assert d.decode == "d2" and d.est_tbt_s == pytest.approx(3 * COST.decode_token_s)


def test_admission_rejects_when_no_choice_meets_targets():
    full = WorkerView("d1", "decode", active_sequences=30)
    d = CacheAware().choose(req(), snap(P1, full, targets=Targets(tbt_s=0.05)))
    assert d.reject and d.prefill is None and d.decode is None and d.kind == "rejected"
    assert "time-between-tokens" in d.reject
    slow = WorkerView("p1", "prefill", queue_tokens=100_000)
    d = CacheAware().choose(req(), snap(slow, D1, targets=Targets(ttft_s=1.0)))
    assert d.reject and "TTFT" in d.reject and d.est_ttft_s > 1.0


# Prefill about as fast as a decode step for a few hundred tokens, as on a GPU.
FAST = dataclasses.replace(COST, prefill_fixed_s=0.002, prefill_token_s=2e-5)


def test_conditional_disaggregation_short_uncached_work_stays_on_decode():
    t = Targets(local_prefill_tokens=300)
    short = CacheAware().choose(req(prompt=200), Snapshot((P1, D1), FAST, t))
    assert short.prefill is None and short.decode == "d1" and short.kind == "local_prefill"
    long = CacheAware().choose(req(prompt=2000), Snapshot((P1, D1), FAST, t))
    assert long.prefill == "p1"
    # A long prompt whose prefix the pool holds leaves little uncached work: local too.
    cached = CacheAware().choose(req(prompt=2080, pool=7), Snapshot((P1, D1), FAST, t))
    assert cached.prefill is None and cached.cached_tokens == 7 * 256
    off = CacheAware().choose(req(prompt=200), Snapshot((P1, D1), FAST, Targets(local_prefill_tokens=0)))
    assert off.prefill == "p1"


def test_a_local_prefill_longer_than_a_token_gap_goes_to_the_prefill_worker():
    # 200 tokens at 1 ms each (a CPU) would hold the decode worker for 21 decode steps.
    t = Targets(local_prefill_tokens=300)
    assert CacheAware().choose(req(prompt=200), snap(P1, D1, targets=t)).kind == "disaggregated"
    # With no prefill worker there is no choice.
    assert CacheAware().choose(req(prompt=200), snap(D1, targets=t)).kind == "local_prefill"


def test_local_prefill_counts_the_stall_it_inflicts_on_running_sequences():
    t = Targets(local_prefill_tokens=300)
    # Idle, the decode worker wins by skipping the hand-off.
    assert CacheAware().choose(req(prompt=200), Snapshot((P1, D1), FAST, t)).kind == "local_prefill"
    # Eight running sequences would each wait for it: the prefill worker is the better place.
    busy = WorkerView("d1", "decode", active_sequences=8)
    moved = CacheAware().choose(req(prompt=200), Snapshot((P1, busy), FAST, t))
    assert moved.kind == "disaggregated" and moved.prefill == "p1"
    # Without a prefill worker, the decode worker prefills whatever it holds up.
    assert CacheAware().choose(req(prompt=200), Snapshot((busy,), FAST, t)).kind == "local_prefill"


def test_local_prefill_is_no_candidate_when_its_stall_breaks_the_tbt_target():
    slow_handoff = dataclasses.replace(COST, handoff_s=1.0)  # by estimate alone, local would win
    one = WorkerView("d1", "decode", active_sequences=1)  # TBT 0.02 s once joined
    t = Targets(tbt_s=0.1, local_prefill_tokens=300)
    long = CacheAware().choose(req(prompt=200), Snapshot((P1, one), slow_handoff, t))
    assert long.kind == "disaggregated"  # a 0.21 s stall would break the 0.1 s target
    tiny = CacheAware().choose(req(prompt=40), Snapshot((P1, one), slow_handoff, t))
    assert tiny.kind == "local_prefill"  # 0.05 s of stall keeps it


def test_colocated_workers_pick_least_ttft():
    a = WorkerView("b1", "both", active_sequences=4, queue_tokens=3000)
    b = WorkerView("b2", "both", local_prefix_chunks=3)
    d = CacheAware().choose(req(prompt=1000, pool=0), snap(a, b))
    assert d.decode == "b2" and d.prefill is None and d.kind == "colocated"


def test_cache_aware_spreads_cold_prefixes_over_the_workers_caches():
    """Equal estimates (a prefix nobody holds, idle workers): the emptier cache takes it, so cold
    conversations alternate between the workers instead of all filling the first one."""
    holdings = {"p1": 0, "p2": 0}
    placed = []
    for i in range(6):
        workers = tuple(WorkerView(n, "prefill", local_cache_chunks=c) for n, c in holdings.items())
        d = CacheAware().choose(req(prompt=600, pool=0, seq=i), snap(*workers, D1))
        placed.append(d.prefill)
        holdings[d.prefill] += 2  # its cache now holds this conversation's 2 chunks
    assert placed == ["p1", "p2"] * 3
    # a held prefix still outweighs a fuller cache
    warm = WorkerView("p1", "prefill", local_cache_chunks=40, local_prefix_chunks=2)
    assert CacheAware().choose(req(prompt=600, pool=0), snap(warm, P2, D1)).prefill == "p1"


def test_round_robin_and_least_loaded():
    rr = [RoundRobin().choose(req(seq=i), snap(P1, P2, D1, D2)) for i in range(4)]
    assert [(d.prefill, d.decode) for d in rr] == [("p1", "d1"), ("p2", "d2"), ("p1", "d1"), ("p2", "d2")]
    loaded = snap(WorkerView("p1", "prefill", queue_tokens=500), P2, WorkerView("d1", "decode", active_sequences=3), D2)
    d = LeastLoaded().choose(req(), loaded)
    assert (d.prefill, d.decode) == ("p2", "d2")


def test_no_workers_and_retry_exclusion():
    for name in POLICIES:
        d = make_policy(name).choose(req(), snap(P1))
        assert d.reject and d.decode is None
    s = without_workers(snap(P1, P2, D1), ["p1"])
    assert [w.name for w in s.workers] == ["p2", "d1"]
    with pytest.raises(Exception, match="unknown routing policy"):
        make_policy("fastest")


views = st.builds(WorkerView, name=st.sampled_from(["a", "b", "c", "d", "e"]),
                  role=st.sampled_from(["prefill", "decode", "both"]),
                  queue_tokens=st.integers(0, 50_000), active_sequences=st.integers(0, 64),
                  kv_tokens=st.integers(0, 100_000), local_prefix_chunks=st.integers(0, 40))


@settings(max_examples=300, deadline=None)
@given(workers=st.lists(views, max_size=6, unique_by=lambda w: w.name), prompt=st.integers(1, 8000),
       pool=st.integers(0, 40), seq=st.integers(0, 1000), policy=st.sampled_from(sorted(POLICIES)),
       ttft=st.one_of(st.none(), st.floats(0.01, 100)), tbt=st.one_of(st.none(), st.floats(0.001, 1)))
def test_decision_invariants(workers, prompt, pool, seq, policy, ttft, tbt):
    r = req(prompt=prompt, pool=pool, seq=seq)
    s = Snapshot(tuple(workers), COST, Targets(ttft_s=ttft, tbt_s=tbt, local_prefill_tokens=128))
    p = make_policy(policy)
    d = p.choose(r, s)
    assert d == p.choose(r, s)  # pure
    by = {w.name: w for w in workers}
    if d.reject is not None:
        assert d.prefill is None and d.decode is None
        return
    assert by[d.decode].decodes
    if d.prefill is not None:
        assert by[d.prefill].prefills and d.prefill != d.decode
    assert d.est_ttft_s >= 0 and d.est_tbt_s >= 0
    assert 0 <= d.cached_tokens < prompt or (prompt == 1 and d.cached_tokens == 0)


def test_cost_model_recovers_coefficients():
    m = CostModel(CostParams(prefill_fixed_s=1.0, prefill_token_s=1.0))
    assert m.params().prefill_fixed_s == 1.0  # the prior until enough samples
    rng = random.Random(3)
    for _ in range(60):
        c, k = rng.randint(16, 4000), rng.randint(0, 4000)
        t = 0.02 + 4e-4 * c + 2e-8 * c * (k + c / 2)
        m.observe_prefill(c, k, t * rng.uniform(0.97, 1.03), fetched_bytes=10_000_000, fetch_s=0.01)
    p = m.params()
    assert p.prefill_token_s == pytest.approx(4e-4, rel=0.15)
    assert p.prefill_attn_s == pytest.approx(2e-8, rel=0.3)
    assert p.fetch_bytes_per_s == pytest.approx(1e9, rel=0.01)
    assert p.prefill_s(1000, 0) == pytest.approx(0.02 + 0.4 + 0.01, rel=0.1)
    m.observe_decode(0.03, 0.05)
    assert m.params().decode_token_s == pytest.approx(0.03) and m.params().decode_step_s == pytest.approx(0.05)


def test_cost_model_refits_only_after_a_new_prefill_sample(monkeypatch):
    """A route reads the model once per request while decode tokens stream in: those update
    their rate without another least-squares fit (~0.2 ms each), and change no prefill estimate;
    with a full window, prefill samples are fitted in batches of 8."""
    import kvpool.router.cost as cost

    fits = []
    real = cost._nnls3
    monkeypatch.setattr(cost, "_nnls3", lambda x, t: fits.append(len(t)) or real(x, t))
    m = CostModel()
    for c in (100, 400, 900, 1600, 2500):
        m.observe_prefill(c, 0, 0.02 + 3e-4 * c)
    fitted = m.params()
    assert fits == [5]
    for s in (0.03, 0.05, 0.04):
        m.observe_decode(s)
        m.observe_handoff(0.012)
        p = m.params()
        assert (p.prefill_fixed_s, p.prefill_token_s, p.prefill_attn_s) == (
            fitted.prefill_fixed_s, fitted.prefill_token_s, fitted.prefill_attn_s)
    assert fits == [5] and p.decode_token_s != fitted.decode_token_s and p.handoff_s == pytest.approx(0.012)
    m.observe_prefill(200, 0, 0.02 + 3e-4 * 200)
    assert m.params().prefill_token_s == pytest.approx(3e-4, rel=0.01) and fits == [5, 6]
    for c in range(100, 12900, 100):  # the window (128) full of new samples
        m.observe_prefill(c, 0, 0.02 + 5e-4 * c)
        m.params()
    fits.clear()
    for c in range(100, 6500, 100):  # then 64 more: refit every 8th
        m.observe_prefill(c, 0, 0.02 + 5e-4 * c)
        m.params()
    assert fits == [128] * 8
    assert m.params().prefill_token_s == pytest.approx(5e-4, rel=0.01)


def test_cached_tokens_leaves_one_token_to_compute():
    r = req(prompt=512, pool=2)
    assert cached_tokens(r, P1) == 511


def test_cost_fit_equals_numpy_least_squares():
    """The route-path fit (pure Python normal equations) chooses the same non-negative fit as
    numpy's lstsq over every subset of columns, on noisy samples of many shapes."""
    import random

    import numpy as np

    from kvpool.router.cost import _nnls3

    def reference(x, t):
        x, t = np.asarray(x), np.asarray(t)
        scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
        best, best_err = None, np.inf
        for mask in range(1, 8):
            cols = [i for i in range(3) if mask >> i & 1]
            sol, *_ = np.linalg.lstsq(x[:, cols] / scale[cols], t, rcond=None)
            err = float(np.sum((x[:, cols] / scale[cols] @ sol - t) ** 2))
            if (sol >= 0).all() and err < best_err:
                best, best_err = np.zeros(3), err
                best[cols] = sol / scale[cols]
        return best

    for trial in range(200):
        rng = random.Random(trial)
        a, b, q = rng.choice([0, 0.02, 1.0]), rng.choice([0, 1e-4, 3e-3]), rng.choice([0, 1e-9, 1e-7])
        rows, times = [], []
        for _ in range(rng.randint(4, 128)):
            c, k = rng.randint(1, 8000), rng.randint(0, 8000)
            rows.append((1.0, float(c), c * (k + c / 2)))
            times.append(max(1e-4, a + b * c + q * c * (k + c / 2) + rng.gauss(0, 0.01)))
        ours, ref = _nnls3(rows, times), reference(rows, times)
        assert min(ours) >= 0
        pred = np.asarray(rows) @ np.asarray(ours)
        assert np.allclose(pred, np.asarray(rows) @ ref, rtol=1e-9, atol=1e-9 * max(times)), trial


def test_decode_line_fits_a_batching_engine_and_falls_back_through_the_origin():
    """A worker's decode steps as a line in the batch size: base + per sequence; with one batch
    size seen, the line goes through the origin (larger batches overestimated, never under)."""
    from kvpool.router.cost import DecodeLine

    line = DecodeLine()
    assert line.fit() == (0.0, 0.0)
    for _ in range(3):
        line.observe(1, 0.087)
    assert line.fit() == (0.0, pytest.approx(0.087))
    for b in (4, 8, 16, 32, 8, 1):
        line.observe(b, 0.075 + 0.012 * b)
    base, per_seq = line.fit()
    assert base == pytest.approx(0.075, rel=0.05) and per_seq == pytest.approx(0.012, rel=0.05)
    cost = CostParams(decode_token_s=per_seq, decode_step_s=base)
    w = WorkerView("d", "decode", active_sequences=15)
    assert tbt_estimate(w, cost) == pytest.approx(0.075 + 16 * 0.012, rel=0.05)
