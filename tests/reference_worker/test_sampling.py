"""Sampling: greedy is an argmax; seeded temperature/top-p draws depend on (seed, position) only,
so prefill worker + decode worker pick the same tokens as one colocated worker."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvpool import worker_api as m
from reference_worker import sampling
from kvpool.errors import InvalidArgument

S = m.SamplingParams


def logits_of(seed: int, vocab: int = 1000) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_with_or_without_params():
    x = logits_of(0)
    want = int(torch.argmax(x))
    assert sampling.pick(x, None, 0) == want
    assert sampling.pick(x, S(temperature=0.0, top_p=0.5, seed=9), 3) == want


def test_same_seed_and_position_same_token_and_the_draw_varies_otherwise():
    x = logits_of(1)
    p = S(temperature=1.0, top_p=1.0, seed=42)
    assert sampling.pick(x, p, 5) == sampling.pick(x.clone(), p, 5)
    by_seed = {sampling.pick(x, S(temperature=1.0, seed=s), 0) for s in range(40)}
    by_index = {sampling.pick(x, p, i) for i in range(40)}
    assert len(by_seed) > 5 and len(by_index) > 5


def test_top_p_keeps_only_the_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    x = probs.log()
    seen = {sampling.pick(x, S(temperature=1.0, top_p=0.75, seed=s), 0) for s in range(300)}
    assert seen == {0, 1}  # 0.5 < 0.75 needs the second; 0.8 >= 0.75 stops there
    tiny = {sampling.pick(logits_of(2), S(temperature=2.0, top_p=1e-9, seed=s), 0) for s in range(50)}
    assert tiny == {int(torch.argmax(logits_of(2)))}


def test_frequencies_follow_the_temperature_scaled_distribution():
    x = torch.tensor([2.0, 1.0, 0.0])
    want = torch.softmax(x / 0.5, dim=0)
    n = 4000
    counts = torch.bincount(torch.tensor([sampling.pick(x, S(temperature=0.5, seed=s), 0) for s in range(n)]),
                            minlength=3).float() / n
    assert torch.allclose(counts, want, atol=0.03), (counts, want)


@pytest.mark.parametrize("params", [S(temperature=-0.1), S(temperature=2.5), S(temperature=float("nan")),
                                    S(top_p=0.0), S(top_p=1.5), S(top_p=-1.0)])
def test_out_of_range_params_are_invalid(params):
    with pytest.raises(InvalidArgument):
        sampling.check(params)


def test_boundaries_are_valid():
    for p in (S(temperature=0.0, top_p=1.0), S(temperature=2.0, top_p=1e-6), None):
        assert sampling.check(p) is p


# -- on the real model, in-process workers sharing one pool ----------------------------------------

PROMPT = "Write a short poem about the sea."
N = 12


def split_tokens(p, d, ids, params):
    async def go():
        head = await p.prefill(m.PrefillRequest(token_ids=ids, sampling=params))
        stream = await d.open_decode(m.DecodeRequest(handle=head.handle, first_token=head.first_token, max_tokens=N,
                                                     stop_token_ids=[], sampling=params))
        return [head.first_token] + [e.token_id async for e in stream if not e.done]
    return asyncio.run(go())


def colocated_tokens(b, ids, params):
    async def go():
        stream = await b.open_generate(m.GenerateRequest(token_ids=ids, max_tokens=N, stop_token_ids=[],
                                                         sampling=params))
        return [e.token_id async for e in stream if not e.done]
    return asyncio.run(go())


@pytest.mark.model
def test_seeded_sampling_is_the_same_split_or_colocated(reference_model, worker_factory):
    p, d, b = worker_factory(role="prefill"), worker_factory(role="decode"), worker_factory(role="both")
    ids = reference_model.encode_chat([{"role": "user", "content": PROMPT}])
    s7 = S(temperature=1.0, top_p=0.95, seed=7)
    split = split_tokens(p, d, ids, s7)
    assert len(split) == N
    assert colocated_tokens(b, ids, s7) == split
    assert colocated_tokens(b, ids, s7) == split  # and again: nothing carries over between requests
    s8 = S(temperature=1.0, top_p=0.95, seed=8)
    other = colocated_tokens(b, ids, s8)
    assert other != split and reference_model.decode(other) != reference_model.decode(split)
    assert split_tokens(p, d, ids, s8) == other


@pytest.mark.model
def test_temperature_zero_is_greedy_generate(reference_model, worker_factory):
    b = worker_factory(role="both")
    ids = reference_model.encode("The capital of France is")
    mask = torch.ones(1, len(ids), dtype=torch.long)
    with torch.inference_mode():
        out = reference_model.model.generate(torch.tensor([ids]), attention_mask=mask, max_new_tokens=N,
                                             do_sample=False)
    want = out[0, len(ids):].tolist()  # ends early at EOS; the workers here never stop (stop_token_ids=[])
    assert colocated_tokens(b, ids, S(temperature=0.0, top_p=0.3, seed=123))[:len(want)] == want
    assert colocated_tokens(b, ids, None)[:len(want)] == want


@pytest.mark.model
def test_the_http_client_carries_sampling_end_to_end(reference_model, worker_factory, http_of):
    """WorkerClient over each worker's real app: `generate(prefill, decode)` == one `both` worker."""
    from reference_worker.client import WorkerClient, generate

    def client_of(worker):
        c = WorkerClient("http://testserver")
        c._http = http_of(worker)  # a TestClient is an httpx.Client: same requests, no socket
        return c

    p, d, b = (client_of(worker_factory(role=r)) for r in ("prefill", "decode", "both"))
    ids = reference_model.encode("Once upon a time")
    params = S(temperature=0.8, top_p=0.9, seed=2024)
    split = generate(p, d, ids, N, sampling=params)
    together = [e.token_id for e in b.generate(ids, N, sampling=params) if not e.done]
    assert split.token_ids == together and split.finish_reason in ("stop", "length")
    assert b.tokenizer_info().chat_template
