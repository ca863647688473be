"""Decode admission: sequences join the batch oldest first within the batch size and KV budget."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from engine_adapters.serving.scheduler import Scheduler
from engine_adapters.serving.sequence import DecodeSequence


def seq(name: str, tokens: int, remaining: int) -> DecodeSequence:
    kv = torch.zeros(1, 1, tokens, 4)
    return DecodeSequence(name, DynamicCache(ddp_cache_data=[(kv, kv.clone())]), 1, remaining, frozenset(),
                          lambda *a: None)


def test_kv_budget_holds_back_later_sequences_but_never_starves_one():
    sched = Scheduler(runner=None, max_batch=8, max_kv_tokens=100)  # never started: admission only
    for s in (seq("big", 150, 10), seq("a", 40, 10), seq("b", 30, 5)):
        sched.submit_decode(s)
    sched._admit()
    assert [s.request_id for s in sched._running] == ["big"]  # over budget alone: admitted anyway
    sched._running.clear()
    sched._admit()
    assert [s.request_id for s in sched._running] == ["a", "b"]  # 50 + 35 <= 100
    assert sched.queue_length == 0


def test_batch_size_limits_admission():
    sched = Scheduler(runner=None, max_batch=2)
    for i in range(3):
        sched.submit_decode(seq(str(i), 4, 1))
    sched._admit()
    assert len(sched._running) == 2 and sched.queue_length == 1
