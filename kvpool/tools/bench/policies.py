"""`kvpool bench policies`: the same prefix-heavy workload (multi-round chat) through three
routers over the same workers, one per policy (round_robin, least_loaded, cache_aware); each run
has its own text (seeded), so no run reuses another's cache. The baseline of cache_aware is the
better of the other two.

Two scenarios, the presets of `--workload`: `shared-pool` (the defaults), a pool that holds
every conversation (all policies get the same reuse from it), and `local-caches`, as in
production: the pool's DRAM is smaller than the conversations' working set, each worker's own
prefix cache holds its share of it, so reuse depends on where a conversation's requests land.
Each run also reports, from the workers' own counters, how many prefills each worker did and
where their prompt tokens came from (local cache, pool, computed), and how many local chunks the
router knew of (its KV events) against what each worker held. Workers run one torch thread each.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Literal

import click
from pydantic import Field, PositiveFloat, PositiveInt

from kvpool.tools.bench.cluster import (clear_caches, counter_delta, extra_router, local_knowledge, row_of,
                                           run_workload, slos_of, start_cluster, worker_counters)
from kvpool.tools.bench.report import Report, progress
from kvpool.tools.workload_file import Size, WorkloadFile, list_of, takes_workload


def _setup_note(scenario: str, n_prefill: int, n_decode: int, local_cache: str | None, pool_dram: str | None,
                conversations: int, rounds: int, system_len: int, system_prompts: int, slos: dict,
                pool_eviction: str | None = None) -> str:
    """The run's setup in words; `kvpool sim validate` reads it back (kvpool/tools/sim/validate.py)."""
    return (f"scenario {scenario}: {n_prefill} prefill + {n_decode} decode workers, 1 torch thread each, local cache "
            f"{local_cache or 'default (512MiB)'}, pool DRAM {pool_dram or 'default (1GiB)'} "
            f"({pool_eviction or 'default'} eviction); {conversations} "
            f"conversations x {rounds} rounds, system prompt {system_len} words ({system_prompts} distinct); "
            f"goodput SLOs {slos}")


class PoliciesWorkload(WorkloadFile):
    """`kvpool bench policies`' keys; the defaults are the `shared-pool` scenario, and
    kvpool/tools/presets/bench-policies/local-caches.toml says why its sizes are what they are."""

    prefill: PositiveInt = Field(2, description="Prefill workers.")
    decode: PositiveInt = Field(1, description="Decode workers.")
    conversations: PositiveInt = Field(6, description="Multi-round chat conversations.")
    rounds: PositiveInt = Field(4, description="User turns each.")
    system_prompts: int = Field(2, ge=0, description="Distinct system prompts, conversation c uses c mod N; "
                                "0: one per conversation.")
    system_len: PositiveInt = Field(600, description="System prompt words.")
    output_len: PositiveInt = Field(16, description="max_tokens per request.")
    pool_dram: Size | None = Field(None, description="The pool's DRAM (`kvpool serve --dram-capacity`; "
                                   "unset: its default, 1GiB).")
    pool_eviction: Literal["lru", "s3fifo", "arc"] | None = Field(None, description="The pool's eviction "
                                                                  "policy (unset: the pool's own, arc).")
    local_cache: Size | None = Field(None, description="Every worker's own prefix cache (`kvpool worker "
                                     "--local-cache`; unset: its default, 512MiB).")
    rate: list_of(PositiveFloat) = Field([1.0], description="Request rates.")
    goodput: list_of(str) = Field(["ttft:2000", "tpot:150"], description="SLOs for goodput (metric:ms).")


@takes_workload("bench policies", PoliciesWorkload)
@click.command()
@click.option("--rate", help="Request rates, comma-separated (key rate).")
@click.option("--workdir", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True)
def policies(workload: PoliciesWorkload, workdir, as_json) -> None:
    """cache_aware vs round_robin vs least_loaded on multi-round chat, same workers.

    \b
    kvpool bench policies --json                               (shared-pool)
    kvpool bench policies --workload local-caches --rate 0.25 --json
    """
    from kvpool.tools.bench.workloads import chat_requests

    w = workload
    scenario = w.source or "shared-pool"
    n_prefill, n_decode, conversations, rounds = w.prefill, w.decode, w.conversations, w.rounds
    system_prompts, system_len, output_len = w.system_prompts, w.system_len, w.output_len
    pool_dram, pool_eviction, local_cache = w.pool_dram, w.pool_eviction, w.local_cache
    workdir = Path(workdir or tempfile.mkdtemp(prefix="kvpool-bench-policies-"))
    slos = slos_of(w.goodput)
    report = Report("policies")
    names = ("round_robin", "least_loaded", "cache_aware")
    worker_args = ["--threads", "1", *(["--local-cache", local_cache] if local_cache is not None else [])]
    pool_args = [*(["--dram-capacity", pool_dram] if pool_dram is not None else []),
                 *(["--eviction", pool_eviction] if pool_eviction is not None else [])]
    cluster = start_cluster(workdir, ["prefill"] * n_prefill + ["decode"] * n_decode, [], worker_args, pool_args)
    routers = []
    try:
        urls = {}
        for name in names:
            proc, url = extra_router(cluster, workdir, f"router-{name}", ["--policy", name])
            routers.append(proc)
            urls[name] = f"{url}/v1"
        rate_list = list(w.rate)
        runs: dict[str, list[Any]] = {n: [] for n in names}
        bar, step = progress(len(rate_list) * len(names), "policies")
        with bar:
            for r_i, rate in enumerate(rate_list):
                for p_i, name in enumerate(names):
                    clear_caches(cluster)
                    reqs = chat_requests(conversations, rounds, system_prompts or conversations, system_len, 48,
                                         output_len, seed=100 * r_i + p_i)
                    before = worker_counters(cluster)
                    res = run_workload(urls[name], reqs, rate, slos, name)
                    row = {**row_of(res), **counter_delta(before, worker_counters(cluster)),
                           "local_chunks_known_held": local_knowledge(cluster, urls[name][:-3])}
                    runs[name].append((rate, row))
                    step()
        for r_i, rate in enumerate(rate_list):
            rows = {n: runs[n][r_i][1] for n in names}
            best_other = {k: min(rows["round_robin"][k], rows["least_loaded"][k]) for k in ("ttft_mean_ms",)}
            best_good = max(rows["round_robin"]["goodput"] or 0, rows["least_loaded"]["goodput"] or 0)
            for n in names:
                report.add(f"ttft_mean/{n}@{rate:g}", [rows[n]["ttft_mean_ms"]], "ms",
                           baseline="best_other_policy" if n == "cache_aware" else None,
                           baseline_values=[best_other["ttft_mean_ms"]] if n == "cache_aware" else None,
                           extra=rows[n])
                report.add(f"goodput/{n}@{rate:g}", [rows[n]["goodput"] or 0.0], "req/s",
                           baseline="best_other_policy" if n == "cache_aware" else None,
                           baseline_values=[best_good] if n == "cache_aware" and best_good > 0 else None)
        report.notes.append(_setup_note(scenario, n_prefill, n_decode, local_cache, pool_dram, conversations, rounds,
                                        system_len, system_prompts or conversations, slos, pool_eviction))
    finally:
        for proc in routers:
            proc.terminate()
            proc.wait(10)
        cluster.stop()
    report.emit(as_json)


