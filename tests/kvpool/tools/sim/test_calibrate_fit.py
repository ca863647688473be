"""`kvpool sim calibrate`'s fit recovers a known profile from samples shaped like the workers'
reports (the measurement itself needs the model and two cores; `kvpool sim calibrate` runs it)."""

from __future__ import annotations

import pytest

from kvpool.tools.sim.calibrate import DECODE_GRID, DECODE_TOKENS, PREFILL_GRID, fit
from kvpool.tools.sim.profile import Profile

# a batching CPU engine: every step reads the weights (75 ms), each sequence adds 12 ms
TRUE = Profile("true", p0=0.03, p_tok=3e-3, p_attn=1e-7, d_weights=0.075, d_seq=0.012, d_kv=2e-6)
BPT = 46080


def _samples() -> dict:
    prefill = []
    for computed, cached in PREFILL_GRID:
        for _ in range(2):
            prefill.append({"computed": computed, "cached": cached, "compute_ms": TRUE.prefill_s(computed, cached) * 1e3,
                            "fetch_ms": cached * BPT / 0.8e9 * 1e3, "push_ms": computed * BPT / 0.4e9 * 1e3,
                            "prefill_ms": 0.0, "fetched_bytes": cached * BPT, "pushed_bytes": computed * BPT})
    decode = []
    for batch, length in DECODE_GRID:
        kv = batch * (length + DECODE_TOKENS / 2)
        step = TRUE.decode_step_s(batch, int(kv)) * 1e3
        open_ms = step + 4.0 + (70.0 + length * BPT / 0.2e9 * 1e3 if batch == 1 else 400.0)  # hop + hand-off + step
        decode.append({"batch": batch, "kv_tokens": kv, "step_ms": step * 0.9, "client_tbt_ms": step, "steps": 11,
                       "prompt": length, "open_ms": open_ms, "kv_bytes": length * BPT})
    return {"prefill": prefill, "decode": decode, "hop_ms": [3.0, 4.0, 5.0]}


def test_fit_recovers_the_profile_that_made_the_samples():
    p = fit(_samples(), BPT)
    assert p.name == "local" and p.bytes_per_token == BPT and p.fused  # chunks ride on decode steps
    for computed, cached in ((100, 0), (700, 300), (1500, 0)):
        assert p.prefill_s(computed, cached) == pytest.approx(TRUE.prefill_s(computed, cached), rel=0.02)
    for batch, kv in ((1, 500), (3, 3000), (8, 8000), (16, 9000)):  # the client's view, not the engine step
        assert p.decode_step_s(batch, kv) == pytest.approx(TRUE.decode_step_s(batch, kv), rel=0.03)
    assert p.d_weights == pytest.approx(0.075, rel=0.05)  # the fixed part a fused prefill chunk shares
    assert p.link_bytes_per_s == pytest.approx(0.8e9, rel=1e-6)
    assert p.push_bytes_per_s == pytest.approx(0.4e9, rel=1e-6)
    assert p.rpc_s == pytest.approx(0.004)
    # the hand-off: fixed 70 ms + bytes at 0.2 GB/s, from the batch-1 decodes only (batched opens wait)
    assert p.pull_fixed_s == pytest.approx(0.070, rel=0.02)
    assert p.pull_bytes_per_s == pytest.approx(0.2e9, rel=0.02)
    assert p.pull_s(1000 * BPT) == pytest.approx(0.070 + 1000 * BPT / 0.2e9, rel=0.02)


def test_a_hand_off_without_a_per_byte_cost_is_a_fixed_cost_only():
    from kvpool.tools.sim.calibrate import _fit_open

    dec = [{"batch": 1, "kv_bytes": n * BPT, "open_ms": 150.0, "client_tbt_ms": 80.0} for n in (64, 1024)]
    fixed, rate = _fit_open(dec, [0.0])
    assert fixed == pytest.approx(0.070) and rate > 1e12

