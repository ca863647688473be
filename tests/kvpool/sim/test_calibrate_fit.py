"""`kvpool sim calibrate`'s fit recovers a known profile from samples shaped like the workers'
reports (the measurement itself needs the model and two cores; `kvpool sim calibrate` runs it)."""

from __future__ import annotations

import pytest

from kvpool.sim.calibrate import DECODE_GRID, DECODE_TOKENS, PREFILL_GRID, fit
from kvpool.sim.profile import Profile

TRUE = Profile("true", p0=0.03, p_tok=3e-3, p_attn=1e-7, d0=0.002, d_seq=0.06, d_kv=2e-6)
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
        decode.append({"batch": batch, "kv_tokens": kv, "step_ms": step * 0.9, "client_tbt_ms": step, "steps": 11,
                       "prompt": length})
    return {"prefill": prefill, "decode": decode, "hop_ms": [3.0, 4.0, 5.0]}


def test_fit_recovers_the_profile_that_made_the_samples():
    p = fit(_samples(), BPT)
    assert p.name == "local" and p.bytes_per_token == BPT and not p.fused
    for computed, cached in ((100, 0), (700, 300), (1500, 0)):
        assert p.prefill_s(computed, cached) == pytest.approx(TRUE.prefill_s(computed, cached), rel=0.02)
    for batch, kv in ((1, 500), (3, 3000), (8, 8000)):  # the client's view, not the engine step
        assert p.decode_step_s(batch, kv) == pytest.approx(TRUE.decode_step_s(batch, kv), rel=0.03)
    assert p.link_bytes_per_s == pytest.approx(0.8e9, rel=1e-6)
    assert p.push_bytes_per_s == pytest.approx(0.4e9, rel=1e-6)
    assert p.rpc_s == pytest.approx(0.004)
