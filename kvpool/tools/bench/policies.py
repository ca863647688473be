"""`kvpool bench policies`: the same prefix-heavy workload (multi-round chat) through three
routers over the same workers, one per policy (round_robin, least_loaded, cache_aware); each run
has its own text (seeded), so no run reuses another's cache. The baseline of cache_aware is the
better of the other two.

Two scenarios (`--scenario`): `shared-pool`, a pool that holds every conversation (all policies
get the same reuse from it), and `local-caches`, as in production: the pool's DRAM is smaller
than the conversations' working set, each worker's own prefix cache holds its share of it, so
reuse depends on where a conversation's requests land. Each run also reports, from the workers'
own counters, how many prefills each worker did and where their prompt tokens came from (local
cache, pool, computed), and how many local chunks the router knew of (its KV events) against
what each worker held. Workers run one torch thread each.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import click

from kvpool.tools.bench.cluster import (clear_caches, counter_delta, extra_router, local_knowledge, row_of,
                                           run_workload, slos_of, start_cluster, worker_counters)
from kvpool.tools.bench.report import Report, progress


def _setup_note(scenario: str, n_prefill: int, n_decode: int, local_cache: str | None, pool_dram: str | None,
                conversations: int, rounds: int, system_len: int, system_prompts: int, slos: dict,
                pool_eviction: str | None = None) -> str:
    """The run's setup in words; `kvpool sim validate` reads it back (kvpool/tools/sim/validate.py)."""
    return (f"scenario {scenario}: {n_prefill} prefill + {n_decode} decode workers, 1 torch thread each, local cache "
            f"{local_cache or 'default (512MiB)'}, pool DRAM {pool_dram or 'default (1GiB)'} "
            f"({pool_eviction or 'default'} eviction); {conversations} "
            f"conversations x {rounds} rounds, system prompt {system_len} words ({system_prompts} distinct); "
            f"goodput SLOs {slos}")


# Defaults of `kvpool bench policies --scenario`; an option given on the command line wins.
# local-caches: 7 conversations, each with its own system prompt (~590 tokens at round 0), reuse 2
# chunks (11.8 MB each in float32) per conversation: 14 chunks (165 MB) in all, more than the
# pool's 128 MiB (10 chunks) keeps across a round, or than one worker's 128 MiB, while each of 2
# prefill workers holds its half (3-4 conversations, 6-8 chunks). The number of conversations is
# odd, so round robin over 2 prefill workers does not keep a conversation on one worker by
# accident (with many users it would not either). The pool evicts least recently used first: it
# still carries every prefill's KV to the decode worker. Under ARC (the default) a pool this small
# evicted just-pushed KV before the decode worker read it (8-11 failed requests of 28 at 0.25 req/s)
# while ARC counted a put as a reference; since it counts reads only, that of 1 request in 84
# (BENCHMARKS.md).
SCENARIOS: dict[str, dict[str, Any]] = {
    "shared-pool": {"conversations": 6, "system_prompts": 2, "system_len": 600, "pool_dram": None,
                    "pool_eviction": None, "local_cache": None},
    "local-caches": {"conversations": 7, "system_prompts": 0, "system_len": 500, "pool_dram": "128MiB",
                     "pool_eviction": "lru", "local_cache": "128MiB"},
}


@click.command()
@click.option("--scenario", type=click.Choice(sorted(SCENARIOS)), default="shared-pool", show_default=True,
              help="shared-pool: the pool holds every conversation; local-caches: the pool's DRAM is smaller "
                   "than the working set, each worker's own prefix cache holds its share (see SCENARIOS).")
@click.option("--prefill", "n_prefill", type=int, default=2, show_default=True)
@click.option("--decode", "n_decode", type=int, default=1, show_default=True)
@click.option("--conversations", type=int, help="Conversations (default: the scenario's, 6 or 7).")
@click.option("--rounds", type=int, default=4, show_default=True)
@click.option("--system-prompts", type=int,
              help="Distinct system prompts, conversation c uses c mod N; 0: one per conversation "
                   "(default: the scenario's, 2 or 0).")
@click.option("--system-len", type=int, help="System prompt words (default: the scenario's, 600 or 500).")
@click.option("--output-len", type=int, default=16, show_default=True)
@click.option("--pool-dram", metavar="SIZE",
              help="The pool's DRAM (`kvpool serve --dram-capacity`; default: the scenario's, 1GiB or 128MiB).")
@click.option("--pool-eviction", type=click.Choice(["lru", "s3fifo", "arc"]),
              help="The pool's eviction policy (default: the scenario's, the pool's own (arc) or lru).")
@click.option("--local-cache", metavar="SIZE",
              help="Every worker's own prefix cache (`kvpool worker --local-cache`; default: the scenario's, "
                   "512MiB or 128MiB).")
@click.option("--rate", "rates", default="1", show_default=True, help="Request rates (comma-separated).")
@click.option("--goodput", multiple=True, default=("ttft:2000", "tpot:150"), show_default=True)
@click.option("--workdir", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True)
def policies(scenario, n_prefill, n_decode, conversations, rounds, system_prompts, system_len, output_len,
             pool_dram, pool_eviction, local_cache, rates, goodput, workdir, as_json) -> None:
    """cache_aware vs round_robin vs least_loaded on multi-round chat, same workers."""
    from kvpool.tools.bench.workloads import chat_requests
    from kvpool.config import parse_size

    preset = SCENARIOS[scenario]
    conversations = preset["conversations"] if conversations is None else conversations
    system_prompts = preset["system_prompts"] if system_prompts is None else system_prompts
    system_len = preset["system_len"] if system_len is None else system_len
    pool_dram = preset["pool_dram"] if pool_dram is None else pool_dram
    local_cache = preset["local_cache"] if local_cache is None else local_cache
    pool_eviction = preset["pool_eviction"] if pool_eviction is None else pool_eviction
    for flag, size in (("--pool-dram", pool_dram), ("--local-cache", local_cache)):
        if size is not None:
            try:
                parse_size(size)
            except ValueError as exc:
                raise click.BadParameter(str(exc), param_hint=flag) from None
    if conversations < 1 or rounds < 1 or system_prompts < 0:
        raise click.BadParameter("--conversations and --rounds must be >= 1, --system-prompts >= 0")
    workdir = Path(workdir or tempfile.mkdtemp(prefix="kvpool-bench-policies-"))
    slos = slos_of(goodput)
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
        rate_list = [float(r) for r in rates.split(",")]
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


