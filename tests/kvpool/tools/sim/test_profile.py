"""Profiles: the closed-form decode interval equals the sum of its steps; JSON round trip; the
GPU roofline numbers are physically sane."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

from kvpool.errors import InvalidArgument
from kvpool.tools.sim.profile import Profile, load_profile
from kvpool.tools.sim.roofline import GPU_PROFILES, gpu_profile

small = st.floats(min_value=0, max_value=1e-2, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(d0=small, d_seq=small, d_weights=small, d_kv=st.floats(0, 1e-6), d_tok=small,
       batch=st.integers(1, 64), kv0=st.integers(0, 100_000), steps=st.integers(0, 300))
def test_decode_steps_closed_form_equals_sum(d0, d_seq, d_weights, d_kv, d_tok, batch, kv0, steps):
    p = Profile("t", d0=d0, d_seq=d_seq, d_weights=d_weights, d_kv=d_kv, d_tok=d_tok)
    direct = sum(p.decode_step_s(batch, kv0 + batch * i) for i in range(steps))
    assert p.decode_steps_s(batch, kv0, steps) == pytest.approx(direct, rel=1e-9, abs=1e-12)
    total = p.decode_steps_s(batch, kv0, steps)
    k = p.steps_within(batch, kv0, total)
    assert k >= steps or total == 0
    assert p.decode_steps_s(batch, kv0, k) <= total * (1 + 1e-12)


def test_profile_json_round_trip_and_validation(tmp_path):
    p = gpu_profile("h100-llama3-8b")
    path = p.save(tmp_path / "p.json")
    assert load_profile(str(path)) == p
    with pytest.raises(InvalidArgument, match="unknown fields"):
        Profile.from_json({**p.to_json(), "bogus": 1})
    with pytest.raises(InvalidArgument, match="negative"):
        Profile.from_json({**p.to_json(), "p_tok": -1.0})
    with pytest.raises(InvalidArgument, match="unknown profile"):
        load_profile("no-such-profile")


def test_roofline_8b_on_h100_is_sane():
    p = gpu_profile("h100-llama3-8b")
    assert p.bytes_per_token == 131072  # 2 * 32 layers * 8 kv heads * 128 * 2 bytes
    # decode at batch 1 is bound by reading 16 GB of weights at ~2.3 TB/s: ~7 ms
    assert 0.005 < p.decode_step_s(1, 1000) < 0.015
    # a 4k prompt is compute-bound: 2 * 8e9 * 4096 FLOPs at ~540 TFLOPs, ~0.1-0.2 s
    assert 0.08 < p.prefill_s(4096, 0) < 0.3
    # a batch of 64 costs far less per sequence than batch 1 (memory-bound decode batches well)
    assert p.decode_step_s(64, 64 * 1000) / 64 < p.decode_step_s(1, 1000) / 4


def test_every_gpu_profile_builds_and_70b_needs_8_cards():
    for name in GPU_PROFILES:
        p = gpu_profile(name)
        assert p.max_kv_tokens > 0 and p.price_per_hour > 0 and math.isfinite(p.p_tok)
    big = gpu_profile("h100x8-llama3-70b")
    assert big.cards == 8 and big.bytes_per_token == 327680
    assert big.price_per_hour == pytest.approx(8 * gpu_profile("h100-llama3-8b").price_per_hour)
