"""Prefill worker -> pool -> decode worker, as real processes, against `model.generate`.

A straight handoff (nothing cached, whole prompt computed in one pass) moves the KV bit-exact,
so greedy tokens must equal a single-process `generate` token for token. Where prefill is split
(cached prefix + computed suffix) the float32 logits differ from one full pass by ~1e-5; the
greedy tokens must still agree, and a flip is reported with its logit margin (see
`assert_same_tokens`) rather than tolerated.
"""

from __future__ import annotations

import concurrent.futures

import pytest

from e2e_support import assert_same_tokens, filler_ids, reference
from reference_worker.client import generate

pytestmark = pytest.mark.model

NEW_TOKENS = 8

SHORT = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "Once upon a time",
         "Translate to French: cheese", "x", "The quick brown fox", "Question: What is 2+2? Answer:",
         "Water boils at"]
CHATS = [
    [{"role": "user", "content": "What is a KV cache?"}],
    [{"role": "user", "content": "Name three colours."}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Capital of Italy?"}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a fact about the moon."}],
    [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "1, 2, 3."},
     {"role": "user", "content": "Now backwards."}],
    [{"role": "user", "content": "What is 7 times 6?"}, {"role": "assistant", "content": "42."},
     {"role": "user", "content": "And 7 times 7?"}, {"role": "assistant", "content": "49."},
     {"role": "user", "content": "And 7 times 8?"}],
]
# Long prompts: a chunk boundary exactly, one past it, no tail, and up to 2,048 tokens.
LONG = [256, 257, 512, 700, 2048]


CASES = ([("short", i) for i in range(len(SHORT))] + [("chat", i) for i in range(len(CHATS))]
         + [("long", i) for i in range(len(LONG))])


def prompt_ids(rm, kind: str, i: int) -> list[int]:
    if kind == "short":
        return rm.encode(SHORT[i])
    if kind == "chat":
        return rm.encode_chat(CHATS[i])
    return filler_ids(rm, LONG[i], seed=1000 + LONG[i])


def test_at_least_twenty_prompts():
    assert len(CASES) >= 20


@pytest.mark.timeout(900)  # a 2,048-token prompt twice (worker + reference) on a shared 2-core box
@pytest.mark.parametrize("kind,i", CASES, ids=[f"{k}{i}" for k, i in CASES])
def test_prompt_matches_generate_token_for_token(rm, prefill, decode, kind, i):
    ids = prompt_ids(rm, kind, i)
    want = reference(rm, ids, NEW_TOKENS)
    gen = generate(prefill, decode, ids, NEW_TOKENS)
    # nothing of these prompts was cached: the straight handoff, which is bit-exact
    assert gen.cached_tokens == 0 and gen.computed_tokens == len(ids)
    assert gen.token_ids == want
    assert gen.finish_reason in ("stop", "length")


def test_colocated_worker_matches_generate(rm, both):
    for ids in (rm.encode("The tallest mountain on Earth is"), filler_ids(rm, 300, seed=7)):
        want = reference(rm, ids, NEW_TOKENS)
        events = list(both.generate(ids, NEW_TOKENS))
        head = events[0].prefill
        assert head is not None and head.computed_tokens == len(ids)
        got = [e.token_id for e in events if not e.done]
        assert got == want
        assert events[-1].done


@pytest.mark.timeout(900)
def test_prefix_reuse_computes_only_uncached_tokens(rm, prefill, decode):
    c = 256
    a = filler_ids(rm, 640, seed=42)
    shared = 576  # 90% of the prompt
    b = a[:shared] + filler_ids(rm, len(a) - shared, seed=43)
    first = generate(prefill, decode, a, NEW_TOKENS)
    assert first.computed_tokens == len(a)

    second = generate(prefill, decode, b, NEW_TOKENS)
    cached = shared // c * c  # only full chunks are content-addressed: 2 chunks = 512 tokens
    assert second.cached_tokens == cached
    assert second.local_cached_tokens == cached  # this worker's own prefix cache answered
    assert second.computed_tokens == len(b) - cached
    assert_same_tokens(rm, b, second.token_ids, reference(rm, b, NEW_TOKENS))

    # Without the worker's local copy the same prefix comes from the pool.
    prefill.clear_cache()
    c2 = a[:shared] + filler_ids(rm, len(a) - shared, seed=44)
    third = generate(prefill, decode, c2, NEW_TOKENS)
    assert third.pool_cached_tokens == cached and third.local_cached_tokens == 0
    assert third.computed_tokens == len(c2) - cached
    assert_same_tokens(rm, c2, third.token_ids, reference(rm, c2, NEW_TOKENS))


def test_decode_batch_sequences_join_and_leave(rm, prefill, decode):
    """Concurrent requests of different lengths share the decode batch; each stays exact."""
    ids_list = [rm.encode(t) for t in ("Alpha beta gamma", "The sea is", "Rain falls on", "Numbers: 4, 8, 15,")]
    budgets = [4, 12, 8, 16]
    heads = [prefill.prefill(ids) for ids in ids_list]

    def run(i: int) -> list[int]:
        out = [heads[i].first_token]
        for event in decode.decode(heads[i].handle, heads[i].first_token, budgets[i]):
            if not event.done:
                out.append(event.token_id)
        return out

    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        results = list(ex.map(run, range(4)))
    for ids, budget, got in zip(ids_list, budgets, results):
        assert got == reference(rm, ids, budget)
    steps = decode.metrics()
    assert "kvpool_worker_decode_batch_size_count" in steps
    report = decode.load()
    assert report.active_sequences == 0 and report.queue_length == 0
