"""The worker core in-process, on the real model and a real embedded pool (fixtures from
tests/engine_adapters/conftest.py): split and chunked prefill numerics, decode-priority
scheduling, typed errors, clean stop."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from kvpool.handle import KVHandle
from kvpool import worker_api as m
from reference_worker.engine import Engine
from reference_worker.model_runner import ModelRunner
from reference_worker.scheduler import Scheduler
from reference_worker.sequence import DecodeSequence, PrefillJob
from reference_worker.service import Worker, WorkerConfig
from kvpool.errors import InvalidArgument, LayoutMismatch, Unavailable

pytestmark = pytest.mark.model


def ids_of(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


def full_pass_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids]), logits_to_keep=1).logits[0, -1]


@pytest.fixture
def worker_factory(reference_model, pool):
    made: list[Worker] = []

    def make(**kw) -> Worker:
        w = Worker(WorkerConfig(**kw), reference_model, pool).start(warmup=False)
        made.append(w)
        return w

    yield make
    for w in made:
        w.stop()


def test_split_prefill_logits_agree_within_1e4(reference_model, worker_factory):
    w = worker_factory(role="prefill", chunk_tokens=128)
    a = ids_of(300, seed=1)
    b = a[:260] + ids_of(40, seed=2)
    asyncio.run(w.prefill(m.PrefillRequest(token_ids=a)))
    job, prefix = asyncio.run(w.run_prefill(b, "split"))
    assert prefix.local_chunks == 2 and job.computed_tokens == len(b) - 256
    want = full_pass_logits(reference_model.model, b)
    diff = float((job.logits - want).abs().max())
    assert diff < 1e-4, f"split prefill logits differ by {diff:.2e}"
    assert int(job.logits.argmax()) == int(want.argmax())


def test_unsplit_prefill_is_bitwise_a_full_pass(reference_model, worker_factory):
    w = worker_factory(role="prefill")
    ids = ids_of(200, seed=3)
    job, _ = asyncio.run(w.run_prefill(ids, "whole"))
    assert torch.equal(job.logits, full_pass_logits(reference_model.model, ids))


def test_chunked_prefill_on_both_agrees_within_1e4(reference_model, worker_factory):
    w = worker_factory(role="both", prefill_chunk_tokens=64)
    ids = ids_of(300, seed=4)
    job, _ = asyncio.run(w.run_prefill(ids, "chunked"))
    want = full_pass_logits(reference_model.model, ids)
    assert float((job.logits - want).abs().max()) < 1e-4
    assert int(job.logits.argmax()) == int(want.argmax())


def test_damaged_pool_chunk_is_recomputed_removed_and_healed(worker_factory, pool, damage):
    """The worker reads through the adapters' one chunk reader: a damaged chunk is a miss, is
    removed (a "removed" pool event), and the prefill's own push stores a good copy again."""
    w = worker_factory(role="prefill", chunk_tokens=64, local_cache_bytes=0)
    ids = ids_of(200, seed=9)  # 3 full chunks + 8 tokens
    asyncio.run(w.prefill(m.PrefillRequest(token_ids=ids)))
    keys = w.adapter.chunk_keys(ids)
    damage(keys[1])
    again = asyncio.run(w.prefill(m.PrefillRequest(token_ids=ids)))
    assert again.pool_cached_tokens == 64 and w.reader.damaged == 1
    pool_events = [(e.kind, e.keys) for e in w.events.since(0).events if e.tier == "pool"]
    assert ("removed", [keys[1]]) in pool_events
    assert pool_events[-1] == ("stored", [keys[1]]), "healed by the push of the same prefill"
    healed = asyncio.run(w.prefill(m.PrefillRequest(token_ids=ids)))
    assert healed.pool_cached_tokens == 192 and w.reader.damaged == 1


def test_decode_steps_come_first_and_prefill_fills_the_gaps(reference_model):
    """While a sequence decodes, a long prefill advances one chunk per step, in the same forward
    as the decode token; the sequence gets a token every step."""
    steps: list[tuple[int, int]] = []
    runner = ModelRunner(reference_model.model)
    engine = Engine(runner, Scheduler(prefill_chunk_tokens=32), on_step=lambda d, p, s: steps.append((d, p)))
    done = threading.Event()
    tokens: list[int] = []

    def emit(token, reason, error):
        assert error is None
        tokens.append(token)
        if reason is not None:
            done.set()

    kv = runner.new_kv(64)
    first = int(torch.argmax(runner.step([(kv, ids_of(20, seed=5))])[0]))
    engine.submit_decode(DecodeSequence("d", kv, first, 12, frozenset(), emit))
    job = PrefillJob("p", ids_of(160, seed=6), runner.new_kv(160))
    engine.submit_prefill(job)
    engine.start()
    try:
        assert done.wait(120) and job.future.result(120) is not None
    finally:
        engine.stop()
    assert len(tokens) == 12
    prefill_steps = [p for d, p in steps if p]
    assert sum(prefill_steps) == 160 and all(p <= 31 for p in prefill_steps)  # 32 less the decode token
    assert all(d == 1 for d, p in steps[:len(prefill_steps)]), steps  # each chunk rode on a decode step


def test_a_sequence_alone_decodes_exactly_like_generate_and_in_a_batch_agrees(reference_model):
    """Alone in its steps, a sequence gets `model.generate`'s greedy tokens; in a batch with three
    others, each gets the tokens it gets alone (this prompt set agrees fully; `kvpool bench engine`
    measures agreement at large)."""
    model = reference_model.model
    runner = ModelRunner(model)
    prompts = [ids_of(n, seed=20 + n) for n in (40, 300, 120, 70)]

    def run(batch: list[list[int]], new: int) -> list[list[int]]:
        engine = Engine(runner, Scheduler(max_batch=8)).start()
        outs: list[list[int]] = [[] for _ in batch]
        dones = [threading.Event() for _ in batch]
        try:
            jobs = [engine.submit_prefill(PrefillJob(str(i), ids, runner.new_kv(len(ids) + new)))
                    for i, ids in enumerate(batch)]
            for i, j in enumerate(jobs):
                outs[i].append(j.future.result(120))

            def emitter(i):
                def emit(token, reason, error):
                    assert error is None
                    outs[i].append(token)
                    if reason is not None:
                        dones[i].set()
                return emit
            for i, j in enumerate(jobs):
                engine.submit_decode(DecodeSequence(str(i), j.kv, outs[i][0], new - 1, frozenset(), emitter(i)))
            assert all(d.wait(120) for d in dones)
        finally:
            engine.stop()
        return outs

    alone = [run([p], 12)[0] for p in prompts]
    for p, got in zip(prompts, alone):
        want = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p):].tolist()
        assert got[:len(want)] == want  # (generate stops at an EOS; these sequences have no stop ids)
    assert run(prompts, 12) == alone


def test_stop_fails_pending_work_with_unavailable(reference_model):
    runner = ModelRunner(reference_model.model)
    engine = Engine(runner, Scheduler())  # never started: nothing runs
    job = engine.submit_prefill(PrefillJob("p", [1, 2, 3], runner.new_kv(8)))
    errors: list[BaseException | None] = []
    engine.submit_decode(DecodeSequence("d", runner.new_kv(8), 1, 3, frozenset(), lambda t, r, e: errors.append(e)))
    engine.stop()
    with pytest.raises(Unavailable):
        job.future.result(timeout=1)
    assert len(errors) == 1 and isinstance(errors[0], Unavailable)
    with pytest.raises(Unavailable):
        engine.submit_prefill(PrefillJob("q", [1, 2], runner.new_kv(8)))


def test_bad_requests_raise_typed_errors(worker_factory):
    p = worker_factory(role="prefill")
    d = worker_factory(role="decode")
    with pytest.raises(InvalidArgument):
        asyncio.run(p.prefill(m.PrefillRequest(token_ids=[])))
    with pytest.raises(InvalidArgument):
        asyncio.run(p.prefill(m.PrefillRequest(token_ids=[1, 10**9])))
    with pytest.raises(InvalidArgument):  # a prefill worker does not decode
        asyncio.run(p.open_decode(m.DecodeRequest(handle=KVHandle(namespace="0" * 32, request_id="r", num_tokens=1,
                                                                  chunk_tokens=256, chunk_keys=[], tail_key="tail/r"),
                                                  first_token=1)))
    other = KVHandle(namespace="f" * 32, request_id="r", num_tokens=1, chunk_tokens=256, chunk_keys=[],
                     tail_key="tail/r")
    with pytest.raises(LayoutMismatch):
        asyncio.run(d.open_decode(m.DecodeRequest(handle=other, first_token=1)))


def test_a_worker_without_a_pool_serves_alone_and_stores_nothing(worker_factory, pool):
    """`--pool none`: a colocated worker that shares nothing (the baseline of what the pool
    costs): the same tokens as a pooled one, no chunk in the pool, its own prefix cache still
    used; a prefill or decode worker cannot be one (they hand KV over through the pool)."""
    ids = ids_of(600, seed=41)

    async def tokens(w) -> list[int]:
        return [e.token_id async for e in await w.open_generate(m.GenerateRequest(token_ids=ids, max_tokens=6))
                if e.token_id is not None and e.token_id >= 0]

    alone = worker_factory(role="both", pool="none")
    pooled = worker_factory(role="both")
    assert asyncio.run(tokens(alone)) == asyncio.run(tokens(pooled))
    keys = alone.adapter.chunk_keys(ids)
    assert len(keys) == 2 and pool.exists_batch(keys) == [True, True]  # the pooled worker stored them
    pool.remove(keys[0])
    pool.remove(keys[1])
    asyncio.run(tokens(alone))  # again: its own cache serves the prefix, nothing reaches the pool
    assert pool.exists_batch(keys) == [False, False]
    assert alone.cache.hits >= 2
    with pytest.raises(InvalidArgument, match="colocated"):
        WorkerConfig(role="prefill", pool="none")


def test_without_a_keyring_decode_still_checks_token_ids_and_namespace(worker_factory, pool):
    """No keyring: handles are unsigned, but a handle without token ids, or of another tenant's
    namespace (salt), is refused before anything is released; a request naming a tenant is refused."""
    import msgspec

    p, d = worker_factory(role="prefill"), worker_factory(role="decode")
    head = asyncio.run(p.prefill(m.PrefillRequest(token_ids=ids_of(300, seed=40))))
    assert head.handle.signature is None and head.handle.token_ids is not None
    stripped = msgspec.structs.replace(head.handle, token_ids=None)
    with pytest.raises(InvalidArgument, match="token ids"):
        asyncio.run(d.open_decode(m.DecodeRequest(handle=stripped, first_token=head.first_token, max_tokens=1)))
    other = worker_factory(role="prefill", tenant_salt="another-tenant")
    theirs = asyncio.run(other.prefill(m.PrefillRequest(token_ids=ids_of(300, seed=40))))
    with pytest.raises(LayoutMismatch):
        asyncio.run(d.open_decode(m.DecodeRequest(handle=theirs.handle, first_token=theirs.first_token, max_tokens=1)))
    # our namespace and token ids, but another tenant's tail (tails are not namespaced): released unread
    # (first token a stop token), the tail is checked first and left, as it names another namespace
    aimed = msgspec.structs.replace(head.handle, tail_key=theirs.handle.tail_key, request_id=theirs.handle.request_id)
    stream = asyncio.run(d.open_decode(m.DecodeRequest(handle=aimed, first_token=head.first_token, max_tokens=1)))
    asyncio.run(_drain(stream))
    assert pool.exists_batch([head.handle.tail_key, theirs.handle.tail_key]) == [True, True]
    stream = asyncio.run(d.open_decode(m.DecodeRequest(handle=head.handle, first_token=head.first_token, max_tokens=1)))
    asyncio.run(_drain(stream))
    pool.flush()
    assert pool.exists_batch([head.handle.tail_key, theirs.handle.tail_key]) == [False, True], "a valid release works"
    with pytest.raises(InvalidArgument, match="keyring"):
        asyncio.run(p.prefill(m.PrefillRequest(token_ids=[1, 2, 3]), tenant="acme"))


async def _drain(stream) -> list:
    return [event async for event in stream]
