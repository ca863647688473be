"""Cluster-level benches on a real local cluster (pool, router, reference workers as processes):

- `kvpool bench policies`: the same prefix-heavy workload (multi-round chat) through three
  routers over the same workers, one per policy (round_robin, least_loaded, cache_aware);
  each run has its own text (seeded), so no run reuses another's cache. The baseline of
  cache_aware is the better of the other two. Two scenarios (`--scenario`): `shared-pool`, a
  pool that holds every conversation (all policies get the same reuse from it), and
  `local-caches`, as in production: the pool's DRAM is smaller than the conversations' working
  set, each worker's own prefix cache holds its share of it, so reuse depends on where a
  conversation's requests land. Each run also reports, from the workers' own counters, how many
  prefills each worker did and where their prompt tokens came from (local cache, pool, computed),
  and how many local chunks the router knew of (its KV events) against what each worker held.
- `kvpool bench disagg`: the seed article's table. The same number of workers colocated (`--role
  both`, decode-priority chunked prefill) vs disaggregated (prefill + decode workers; pure, and
  with conditional disaggregation), under a mixed load of long and short prompts at several
  rates: TTFT mean and std, TPOT p99, ITL p99 (the gaps between tokens: a decode stalled by a
  prefill shows there), E2E p99, throughput, goodput, and each worker's busy
  fraction (seconds in forward passes over the run's wall time: the "GPU utilization" row).

Both start processes (pool, router, reference workers). Workers run one torch thread each, so N
workers use N of the machine's cores.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import click
import httpx

from kvpool.auth import AUTH_FILE_ENV, load_keyring
from kvpool.bench.report import Report, progress
from kvpool.http_guard import internal_headers

_BUSY = re.compile(r"^kvpool_worker_(?:decode_step|prefill_chunk)_seconds_sum (\S+)$", re.M)
_PROMPT = re.compile(r'^kvpool_worker_prompt_tokens_total\{source="(\w+)"\} (\S+)$', re.M)
_PREFILLS = re.compile(r'^kvpool_worker_requests_total\{kind="prefill"\} (\S+)$', re.M)
_LOCAL_TOKENS = re.compile(r"^kvpool_worker_local_cache_tokens (\S+)$", re.M)
_DECISIONS = re.compile(r'^kvpool_router_decisions_total\{[^}]*kind="(\w+)"[^}]*\} (\S+)$', re.M)


def _busy_seconds(url: str) -> float:
    return sum(float(v) for v in _BUSY.findall(httpx.get(f"{url}/metrics", timeout=10).text))


def _start(workdir: Path, roles: list[str], router_args: list[str], worker_args: list[str],
           pool_args: list[str] = ()):
    from engine_adapters.serving.launcher import LocalCluster, PoolSpec, RouterSpec, WorkerSpec

    specs = [WorkerSpec(role, f"{role}-{i}", list(worker_args)) for i, role in enumerate(roles)]
    return LocalCluster(workdir, specs, pool=PoolSpec(args=list(pool_args)),
                        router=RouterSpec(args=router_args)).start()


def _worker_counters(cluster) -> dict[str, dict[str, float]]:
    """Per worker: prefills done and prompt tokens by source (local, pool, computed), cumulative."""
    out = {}
    for name, proc in cluster.workers.items():
        text = httpx.get(f"{proc.url}/metrics", timeout=10).text
        row = {src: float(v) for src, v in _PROMPT.findall(text)}
        row["prefills"] = sum(float(v) for v in _PREFILLS.findall(text))
        out[name] = row
    return out


def _counter_delta(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, Any]:
    """What one run did: prefills per worker, and prompt tokens by source over all workers."""
    per_worker = {n: int(after[n].get("prefills", 0) - before[n].get("prefills", 0)) for n in after}
    tokens = {src: int(sum(after[n].get(src, 0) - before[n].get(src, 0) for n in after))
              for src in ("local", "pool", "computed")}
    total = sum(tokens.values())
    return {"prefills_by_worker": per_worker, "prompt_tokens_by_source": tokens,
            "hit_ratio": (tokens["local"] + tokens["pool"]) / total if total else None}


def _internal(cluster) -> dict[str, str]:
    """Headers for the router's /admin and /metrics (its internal token, with a keyring)."""
    return internal_headers(load_keyring(cluster.env.get(AUTH_FILE_ENV)))


def _local_knowledge(cluster, router_url: str, chunk_tokens: int = 256) -> dict[str, list[int]]:
    """Per worker: [local chunks the router knows of from its KV events, chunks the worker holds]."""
    listed = httpx.get(f"{router_url}/admin/workers", timeout=10, headers=_internal(cluster)).json()["workers"]
    known = {w["url"]: w["local_cache_chunks"] for w in listed}
    out = {}
    for name, proc in cluster.workers.items():
        held = sum(float(v) for v in _LOCAL_TOKENS.findall(httpx.get(f"{proc.url}/metrics", timeout=10).text))
        out[name] = [known.get(proc.url, -1), int(held) // chunk_tokens]
    return out


def _router_decisions(cluster) -> dict[str, float]:
    """The router's routing decisions so far, by kind (disaggregated, local_prefill, colocated, ...)."""
    text = httpx.get(f"{cluster.router_url}/metrics", timeout=10, headers=_internal(cluster)).text
    out: dict[str, float] = {}
    for kind, value in _DECISIONS.findall(text):
        out[kind] = out.get(kind, 0.0) + float(value)
    return out


def _extra_router(cluster, workdir: Path, name: str, args: list[str]) -> tuple[subprocess.Popen, str]:
    from engine_adapters.serving.launcher import KVPOOL

    ready = workdir / f"{name}.ready"
    workers = [x for p in cluster.workers.values() for x in ("--worker", p.url)]
    log = open(workdir / f"{name}.log", "wb")
    proc = subprocess.Popen([*KVPOOL, "router", "--port", "0", "--pool", cluster.pool_address, "--ready-file",
                             str(ready), *args, *workers], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise click.ClickException(f"router {name} did not start; see {workdir / (name + '.log')}")
        time.sleep(0.05)
    url = json.loads(ready.read_text())["url"]
    while httpx.get(f"{url}/health", timeout=5).status_code != 200:
        time.sleep(0.1)
    return proc, url


def _clear_caches(cluster) -> None:
    for proc in cluster.workers.values():
        httpx.post(f"{proc.url}/v1/cache/clear", timeout=30)


def _run(base_url: str, requests: list, rate: float, slos: dict[str, float], label: str) -> Any:
    from kvpool.bench.serve_client import run_serve_bench

    return run_serve_bench(base_url, requests, rate, slos_ms=slos, label=label, seed=int(rate * 1000))


def _row(res: Any) -> dict[str, Any]:
    m = res.metrics
    return {"completed": m.completed, "failed": m.failed, "ttft_mean_ms": m.ttft.mean,
            "ttft_std_ms": m.ttft.std, "ttft_p99_ms": m.ttft.p99, "tpot_mean_ms": m.tpot.mean,
            "tpot_p99_ms": m.tpot.p99, "itl_p99_ms": m.itl.p99, "e2e_p99_ms": m.e2e.p99,
            "req_per_s": m.request_throughput, "out_tok_per_s": m.output_throughput, "goodput": m.goodput,
            "mean_cached_tokens": m.mean_cached_tokens, "duration_s": m.duration_s, "errors": m.errors[:3]}


def _slos(goodput: tuple[str, ...]) -> dict[str, float]:
    from kvpool.bench.serve_metrics import parse_slo

    return dict(parse_slo(g) for g in goodput)


def _setup_note(scenario: str, n_prefill: int, n_decode: int, local_cache: str | None, pool_dram: str | None,
                conversations: int, rounds: int, system_len: int, system_prompts: int, slos: dict,
                pool_eviction: str | None = None) -> str:
    """The run's setup in words; `kvpool sim validate` reads it back (kvpool/sim/validate.py)."""
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
    from kvpool.bench.workloads import chat_requests
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
    slos = _slos(goodput)
    report = Report("policies")
    names = ("round_robin", "least_loaded", "cache_aware")
    worker_args = ["--threads", "1", *(["--local-cache", local_cache] if local_cache is not None else [])]
    pool_args = [*(["--dram-capacity", pool_dram] if pool_dram is not None else []),
                 *(["--eviction", pool_eviction] if pool_eviction is not None else [])]
    cluster = _start(workdir, ["prefill"] * n_prefill + ["decode"] * n_decode, [], worker_args, pool_args)
    routers = []
    try:
        urls = {}
        for name in names:
            proc, url = _extra_router(cluster, workdir, f"router-{name}", ["--policy", name])
            routers.append(proc)
            urls[name] = f"{url}/v1"
        rate_list = [float(r) for r in rates.split(",")]
        runs: dict[str, list[Any]] = {n: [] for n in names}
        bar, step = progress(len(rate_list) * len(names), "policies")
        with bar:
            for r_i, rate in enumerate(rate_list):
                for p_i, name in enumerate(names):
                    _clear_caches(cluster)
                    reqs = chat_requests(conversations, rounds, system_prompts or conversations, system_len, 48,
                                         output_len, seed=100 * r_i + p_i)
                    before = _worker_counters(cluster)
                    res = _run(urls[name], reqs, rate, slos, name)
                    row = {**_row(res), **_counter_delta(before, _worker_counters(cluster)),
                           "local_chunks_known_held": _local_knowledge(cluster, urls[name][:-3])}
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


CONFIGS = {
    "colocated": (lambda n: ["both"] * n, ["--local-prefill-tokens", "0"]),
    "disaggregated": (lambda n: ["prefill"] * (n // 2) + ["decode"] * (n - n // 2), ["--local-prefill-tokens", "0"]),
    "disagg+conditional": (lambda n: ["prefill"] * (n // 2) + ["decode"] * (n - n // 2), []),
}


@click.command()
@click.option("--workers", "n_workers", type=int, default=2, show_default=True, help="Workers in every config.")
@click.option("--config", "configs", multiple=True, type=click.Choice(sorted(CONFIGS)),
              help="Configs to run (default: all).")
@click.option("--num-requests", type=int, default=24, show_default=True, help="Requests per rate.")
@click.option("--input-len", type=int, default=500, show_default=True, help="Mean prompt words.")
@click.option("--output-len", type=int, default=48, show_default=True, help="Mean answer tokens.")
@click.option("--range-ratio", type=float, default=0.9, show_default=True, help="Lengths vary by ± this.")
@click.option("--rate", "rates", default="0.2,0.4,0.8", show_default=True, help="Request rates.")
@click.option("--goodput", multiple=True, default=("ttft:3000", "tpot:150"), show_default=True)
@click.option("--workdir", type=click.Path(file_okay=False))
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write the table as a PNG here.")
@click.option("--json", "as_json", is_flag=True)
def disagg(n_workers, configs, num_requests, input_len, output_len, range_ratio, rates, goodput, workdir,
           plot_path, as_json) -> None:
    """Colocated vs disaggregated at the same number of workers (the seed's table)."""
    from kvpool.bench.workloads import random_requests

    workdir = Path(workdir or tempfile.mkdtemp(prefix="kvpool-bench-disagg-"))
    slos = _slos(goodput)
    report = Report("disagg")
    rate_list = [float(r) for r in rates.split(",")]
    table: dict[str, list[dict[str, Any]]] = {}
    for name in configs or CONFIGS:
        roles_of, router_args = CONFIGS[name]
        cluster = _start(workdir / name, roles_of(n_workers), router_args, ["--threads", "1"])
        try:
            base = f"{cluster.router_url}/v1"
            _run(base, random_requests(2, 64, 4, seed=999), 10.0, slos, "warmup")
            bar, step = progress(len(rate_list), name)
            with bar:
                for r_i, rate in enumerate(rate_list):
                    _clear_caches(cluster)
                    before = {n: _busy_seconds(p.url) for n, p in cluster.workers.items()}
                    decided = _router_decisions(cluster)
                    res = _run(base, random_requests(num_requests, input_len, output_len, range_ratio, seed=r_i),
                               rate, slos, name)
                    busy = {n: (_busy_seconds(p.url) - before[n]) / res.metrics.duration_s
                            for n, p in cluster.workers.items()}
                    decisions = {k: int(v - decided.get(k, 0)) for k, v in _router_decisions(cluster).items()
                                 if v > decided.get(k, 0)}
                    row = {"rate": rate, **_row(res), "busy": busy, "busy_mean": statistics.fmean(busy.values()),
                           "decisions": decisions}
                    table.setdefault(name, []).append(row)
                    step()
            fitted = httpx.get(f"{cluster.router_url}/admin/workers", timeout=10, headers=_internal(cluster)).json()
            report.notes.append(f"{name}: router's fitted cost model after the runs ({fitted['cost_samples']} "
                                f"prefills): " + ", ".join(f"{k}={v:.3g}" for k, v in fitted["cost"].items()))
        finally:
            cluster.stop()
    for name, rows in table.items():
        for row in rows:
            base_row = next((r for r in table.get("colocated", []) if r["rate"] == row["rate"]), None)
            for key, unit in (("ttft_mean_ms", "ms"), ("ttft_std_ms", "ms"), ("tpot_p99_ms", "ms"),
                              ("itl_p99_ms", "ms"), ("e2e_p99_ms", "ms"), ("out_tok_per_s", "tok/s"),
                              ("goodput", "req/s"), ("busy_mean", "fraction")):
                value = row[key] or 0.0
                is_base = name == "colocated" or base_row is None
                report.add(f"{key}/{name}@{row['rate']:g}", [value], unit,
                           baseline=None if is_base else "colocated",
                           baseline_values=None if is_base or not base_row[key] else [base_row[key]],
                           extra={k: row[k] for k in ("busy", "decisions")} if key == "busy_mean" else None)
    report.notes.append(f"{n_workers} workers per config, 1 torch thread each; {num_requests} requests per rate, "
                        f"prompt {input_len}±{int(range_ratio * 100)}% words, answer {output_len}±"
                        f"{int(range_ratio * 100)}% tokens; goodput SLOs {slos}")
    if plot_path:
        report.notes.append(plot_table(report.document(), Path(plot_path)))
    report.emit(as_json)


def plot_table(doc: dict[str, Any], path: Path) -> str:
    """One panel per metric of `kvpool bench disagg`'s JSON, one line per config, against rate."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed: no plot"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for r in doc["results"]:
        metric, rest = r["case"].split("/")
        config, rate = rest.rsplit("@", 1)
        series.setdefault(metric, {}).setdefault(config, []).append((float(rate), r["value"]))
    fig, axes = plt.subplots(2, (len(series) + 1) // 2, figsize=(4 * ((len(series) + 1) // 2), 7))
    for ax, (metric, by_config) in zip(axes.flat, series.items()):
        for config, points in by_config.items():
            xs, ys = zip(*sorted(points))
            ax.plot(xs, ys, marker="o", label=config)
        ax.set_title(metric)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    for ax in list(axes.flat)[len(series):]:
        ax.axis("off")
    fig.suptitle("colocated vs disaggregated (kvpool bench disagg)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return f"plot written to {path}"
