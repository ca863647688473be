"""The scheduler's plan of a step, without a model: decode admission (oldest first within the
batch size and KV budget), decode first, prefill under the token budget, packing of short prompts."""

from __future__ import annotations

import torch

from reference_worker.kv_cache import SequenceKV
from reference_worker.scheduler import PACK_TOKENS, Scheduler
from reference_worker.sequence import DecodeSequence, PrefillJob


def kv(tokens: int) -> SequenceKV:
    cache = SequenceKV((1, 1, 4), torch.float32, capacity=tokens)
    cache.length = tokens
    return cache


def seq(name: str, tokens: int, remaining: int) -> DecodeSequence:
    return DecodeSequence(name, kv(tokens), 1, remaining, frozenset(), lambda *a: None)


def job(name: str, prompt: int, cached: int = 0) -> PrefillJob:
    return PrefillJob(name, list(range(prompt)), kv(cached))


def test_kv_budget_holds_back_later_sequences_but_never_starves_one():
    sched = Scheduler(max_batch=8, max_kv_tokens=100)
    sched.joining.extend([seq("big", 150, 10), seq("a", 40, 10), seq("b", 30, 5)])
    assert [s.request_id for s in sched.schedule().decodes] == ["big"]  # over budget alone: admitted anyway
    sched.finish_decode(sched.running[0])
    assert [s.request_id for s in sched.schedule().decodes] == ["a", "b"]  # 50 + 35 <= 100
    assert not sched.joining


def test_batch_size_limits_admission_and_cancelled_sequences_leave():
    sched = Scheduler(max_batch=2)
    seqs = [seq(str(i), 4, 1) for i in range(3)]
    sched.joining.extend(seqs)
    assert len(sched.schedule().decodes) == 2 and len(sched.joining) == 1
    seqs[0].cancelled = True
    assert [s.request_id for s in sched.schedule().decodes] == ["1", "2"]
    assert seqs[0].finished and seqs[0] not in sched.running


def test_decode_first_then_a_chunk_of_the_oldest_prompt():
    sched = Scheduler(prefill_chunk_tokens=64)
    sched.joining.extend([seq("d1", 10, 5), seq("d2", 10, 5)])
    sched.prefills.extend([job("long", 500), job("short", 8)])
    step = sched.schedule()
    assert [s.request_id for s in step.decodes] == ["d1", "d2"]
    assert [(j.request_id, n) for j, n in step.prefills] == [("long", 62)]  # 64 less the 2 decode tokens
    assert step.tokens == 64


def test_a_full_batch_leaves_prefill_a_quarter_of_the_budget():
    sched = Scheduler(max_batch=64, prefill_chunk_tokens=32)
    sched.joining.extend(seq(str(i), 4, 9) for i in range(40))
    sched.prefills.append(job("p", 100))
    step = sched.schedule()
    assert len(step.decodes) == 40 and step.prefills[0][1] == 8


def test_whole_prompts_by_default_and_short_ones_packed():
    sched = Scheduler()  # a prefill worker: no chunking
    sched.prefills.extend([job("a", 1000, cached=256), job("b", 100), job("c", 100), job("d", 90)])
    step = sched.schedule()
    assert [(j.request_id, n) for j, n in step.prefills] == [("a", 744)]  # long: alone, whole
    sched.finish_prefill(sched.prefills[0])
    step = sched.schedule()
    assert [j.request_id for j, _ in step.prefills] == ["b", "c"]  # 200 <= PACK_TOKENS; +90 would not fit
    assert sum(n for _, n in step.prefills) <= PACK_TOKENS


def test_a_prompt_whose_caller_left_is_dropped_uncomputed():
    sched = Scheduler()
    gone, kept = job("gone", 10), job("kept", 10)
    gone.future.cancel()
    sched.prefills.extend([gone, kept])
    step = sched.schedule()
    assert [j.request_id for j, _ in step.prefills] == ["kept"] and gone not in sched.prefills
    assert kept.future.running()  # marked before computing: it can no longer be cancelled
