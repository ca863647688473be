"""`kvpool bench engine`: what batching buys the reference engine, against the same sequences run
one after another at batch 1, in the same run.

For each batch size B (key `batches` of `--workload`/`--set`): B prompts of `context` tokens are
prefilled once (not timed); then, alternating, each repetition decodes `new_tokens` for every sequence
- as one batch: every step is one forward over the B sequences (`ModelRunner.step`, what the
  engine thread runs), and
- one sequence after another, each alone in its steps (the baseline: the engine as it was, a
  batch-1 forward per sequence per step),
each from a fresh copy of the prefilled KV. `decode_batch_<B>` is tokens/s (B x new tokens over
the time), its ratio the speedup over the baseline (goal: >= 3x at 16).

`greedy_agreement` (in `extra`): the fraction of each sequence's tokens in the batch that equal
its tokens alone, counted up to the first difference (a free-running, strict measure: after a
near-tie flips one token, every later position counts as a miss). A lone sequence is exact by
construction (`model_runner.py`); a batch changes the matmuls' shapes and so their rounding.

`prefill_packed_<n>`: four prompts of n tokens in one forward vs one after another (tokens/s):
where packing prompts pays on a CPU (the scheduler's `PACK_TOKENS`).
"""

from __future__ import annotations

import random
import time

import click
from pydantic import Field, PositiveInt

from kvpool.tools.bench.report import Report, progress
from kvpool.tools.workload_file import WorkloadFile, list_of, takes_workload


class EngineWorkload(WorkloadFile):
    """`kvpool bench engine`'s keys; the defaults are the `batching` preset (BENCHMARKS.md)."""

    batches: list_of(PositiveInt) = Field([1, 4, 8, 16, 32], description="Batch sizes.")
    context: PositiveInt = Field(800, description="Prompt tokens per sequence.")
    new_tokens: PositiveInt = Field(8, description="Decode steps timed per repetition.")
    reps: PositiveInt = Field(3, description="Measured repetitions (after 1 warm-up).")
    threads: PositiveInt = Field(1, description="torch threads (one: what a worker pinned to one core runs with).")
    pack: list_of(PositiveInt) = Field([16, 64, 256, 512], description="Prompt lengths of the packed-prefill "
                                       "case ([]: none).")


@takes_workload("bench engine", EngineWorkload)
@click.command()
@click.option("--threads", type=click.IntRange(min=1), help="torch threads (key threads).")
@click.option("--json", "as_json", is_flag=True, help="End with one JSON line.")
def engine(workload: EngineWorkload, as_json: bool) -> None:
    """Decode tokens/s at each batch size vs batch-1 sequences one after another."""
    import torch

    from reference_worker.model import load_reference_model
    from reference_worker.model_runner import ModelRunner

    context, new_tokens, reps, threads = workload.context, workload.new_tokens, workload.reps, workload.threads
    torch.set_num_threads(threads)
    sizes, packs = list(workload.batches), list(workload.pack)
    rm = load_reference_model()
    runner = ModelRunner(rm.model)
    rng = random.Random(7)
    vocab = rm.model.config.vocab_size
    report = Report("engine")
    steps = sum(sizes) * 2 + len(packs) * 2
    bar, advance = progress((reps + 1) * steps, f"engine bench ({threads} thread(s), {context}-token contexts)")
    with bar:
        for b in sizes:
            prompts = [[rng.randrange(100, vocab) for _ in range(context)] for _ in range(b)]
            seeds = []
            for ids in prompts:  # prefilled once; every run decodes from a copy
                kv = runner.new_kv(context + new_tokens + 1)
                logits = runner.step([(kv, ids)])
                seeds.append((kv, int(logits[0].argmax())))
            batched_s, alone_s, agree = [], [], []
            for rep in range(reps + 1):
                t_b, toks_b = _decode(runner, seeds, new_tokens, batched=True, tick=advance)
                t_a, toks_a = _decode(runner, seeds, new_tokens, batched=False, tick=advance)
                if rep:
                    batched_s.append(b * new_tokens / t_b)
                    alone_s.append(b * new_tokens / t_a)
                agree.append(_agreement(toks_b, toks_a))
            report.add(f"decode_batch_{b}", batched_s, "tokens/s", size=b, baseline="batch1_one_after_another",
                       baseline_values=alone_s,
                       extra={"context_tokens": context, "new_tokens": new_tokens, "threads": threads,
                              "greedy_agreement": round(min(agree), 4),
                              "step_ms": round(1e3 * b / _median(batched_s), 2)})
        for n in packs:
            prompts = [[rng.randrange(100, vocab) for _ in range(n)] for _ in range(4)]
            packed, serial = [], []
            for rep in range(reps + 1):
                t_p = _timed(lambda: runner.step([(runner.new_kv(n), ids) for ids in prompts]))
                advance()
                t_s = _timed(lambda: [runner.step([(runner.new_kv(n), ids)]) for ids in prompts])
                advance()
                if rep:
                    packed.append(4 * n / t_p)
                    serial.append(4 * n / t_s)
            report.add(f"prefill_packed_{n}", packed, "tokens/s", size=n, baseline="one_after_another",
                       baseline_values=serial, extra={"prompts": 4, "threads": threads})
    report.notes.append(f"{rm.model_id} ({rm.dtype}), {threads} torch thread(s); decode from {context}-token "
                        f"contexts, {new_tokens} tokens per sequence per repetition; goal: decode_batch_16 ratio >= 3")
    report.emit(as_json)


def _decode(runner, seeds, new_tokens: int, *, batched: bool, tick) -> tuple[float, list[list[int]]]:
    """Seconds to decode `new_tokens` for each seeded sequence (from copies of their KV), and the tokens."""
    kvs = [kv.clone() for kv, _ in seeds]
    tokens = [[first] for _, first in seeds]
    started = time.perf_counter()
    if batched:
        for _ in range(new_tokens):
            logits = runner.step([(kv, [t[-1]]) for kv, t in zip(kvs, tokens)])
            for t, row in zip(tokens, logits):
                t.append(int(row.argmax()))
    else:
        for kv, t in zip(kvs, tokens):
            for _ in range(new_tokens):
                t.append(int(runner.step([(kv, [t[-1]])])[0].argmax()))
    elapsed = time.perf_counter() - started
    for _ in seeds:
        tick()
    return elapsed, tokens


def _agreement(batched: list[list[int]], alone: list[list[int]]) -> float:
    """Tokens equal to the lone run's before each sequence's first difference, over all tokens."""
    same = total = 0
    for a, b in zip(batched, alone):
        total += len(b) - 1
        for x, y in zip(a[1:], b[1:]):
            if x != y:
                break
            same += 1
    return same / total if total else 1.0


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _median(values: list[float]) -> float:
    import statistics

    return statistics.median(values)
