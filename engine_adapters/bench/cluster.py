"""Cluster-level benches on a real local cluster (pool, router, reference workers as processes):

- `kvpool bench policies`: the same prefix-heavy workload (multi-round chat) through three
  routers over the same workers, one per policy (round_robin, least_loaded, cache_aware);
  each run has its own text (seeded), so no run reuses another's cache. The baseline of
  cache_aware is the better of the other two.
- `kvpool bench disagg`: the seed article's table. The same number of workers colocated (`--role
  both`, decode-priority chunked prefill) vs disaggregated (prefill + decode workers; pure, and
  with conditional disaggregation), under a mixed load of long and short prompts at several
  rates: TTFT mean and std, TPOT p99, E2E p99, throughput, goodput, and each worker's busy
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


def _busy_seconds(url: str) -> float:
    return sum(float(v) for v in _BUSY.findall(httpx.get(f"{url}/metrics", timeout=10).text))


def _start(workdir: Path, roles: list[str], router_args: list[str], worker_args: list[str]):
    from engine_adapters.serving.launcher import LocalCluster, RouterSpec, WorkerSpec

    specs = [WorkerSpec(role, f"{role}-{i}", list(worker_args)) for i, role in enumerate(roles)]
    return LocalCluster(workdir, specs, router=RouterSpec(args=router_args)).start()


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
            "tpot_p99_ms": m.tpot.p99, "e2e_p99_ms": m.e2e.p99, "req_per_s": m.request_throughput,
            "out_tok_per_s": m.output_throughput, "goodput": m.goodput, "mean_cached_tokens": m.mean_cached_tokens,
            "duration_s": m.duration_s, "errors": m.errors[:3]}


def _slos(goodput: tuple[str, ...]) -> dict[str, float]:
    from kvpool.bench.serve_metrics import parse_slo

    return dict(parse_slo(g) for g in goodput)


@click.command()
@click.option("--prefill", "n_prefill", type=int, default=2, show_default=True)
@click.option("--decode", "n_decode", type=int, default=1, show_default=True)
@click.option("--conversations", type=int, default=6, show_default=True)
@click.option("--rounds", type=int, default=4, show_default=True)
@click.option("--system-len", type=int, default=600, show_default=True, help="Shared system prompt words.")
@click.option("--output-len", type=int, default=16, show_default=True)
@click.option("--rate", "rates", default="1", show_default=True, help="Request rates (comma-separated).")
@click.option("--goodput", multiple=True, default=("ttft:2000", "tpot:150"), show_default=True)
@click.option("--workdir", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True)
def policies(n_prefill, n_decode, conversations, rounds, system_len, output_len, rates, goodput, workdir,
             as_json) -> None:
    """cache_aware vs round_robin vs least_loaded on multi-round chat, same workers."""
    from kvpool.bench.workloads import chat_requests

    workdir = Path(workdir or tempfile.mkdtemp(prefix="kvpool-bench-policies-"))
    slos = _slos(goodput)
    report = Report("policies")
    names = ("round_robin", "least_loaded", "cache_aware")
    cluster = _start(workdir, ["prefill"] * n_prefill + ["decode"] * n_decode, [], ["--threads", "1"])
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
                    reqs = chat_requests(conversations, rounds, 2, system_len, 48, output_len,
                                         seed=100 * r_i + p_i)
                    runs[name].append((rate, _run(urls[name], reqs, rate, slos, name)))
                    step()
        for r_i, rate in enumerate(rate_list):
            rows = {n: _row(runs[n][r_i][1]) for n in names}
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
        report.notes.append(f"{n_prefill} prefill + {n_decode} decode workers, 1 torch thread each; "
                            f"{conversations} conversations x {rounds} rounds, system prompt {system_len} words; "
                            f"goodput SLOs {slos}")
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
                    res = _run(base, random_requests(num_requests, input_len, output_len, range_ratio, seed=r_i),
                               rate, slos, name)
                    busy = {n: (_busy_seconds(p.url) - before[n]) / res.metrics.duration_s
                            for n, p in cluster.workers.items()}
                    row = {"rate": rate, **_row(res), "busy": busy, "busy_mean": statistics.fmean(busy.values())}
                    table.setdefault(name, []).append(row)
                    step()
            fitted = httpx.get(f"{cluster.router_url}/admin/workers", timeout=10,
                               headers=internal_headers(load_keyring(cluster.env.get(AUTH_FILE_ENV)))).json()
            report.notes.append(f"{name}: router's fitted cost model after the runs ({fitted['cost_samples']} "
                                f"prefills): " + ", ".join(f"{k}={v:.3g}" for k, v in fitted["cost"].items()))
        finally:
            cluster.stop()
    for name, rows in table.items():
        for row in rows:
            base_row = next((r for r in table.get("colocated", []) if r["rate"] == row["rate"]), None)
            for key, unit in (("ttft_mean_ms", "ms"), ("ttft_std_ms", "ms"), ("tpot_p99_ms", "ms"),
                              ("e2e_p99_ms", "ms"), ("out_tok_per_s", "tok/s"), ("goodput", "req/s"),
                              ("busy_mean", "fraction")):
                value = row[key] or 0.0
                is_base = name == "colocated" or base_row is None
                report.add(f"{key}/{name}@{row['rate']:g}", [value], unit,
                           baseline=None if is_base else "colocated",
                           baseline_values=None if is_base or not base_row[key] else [base_row[key]],
                           extra={k: v for k, v in row.items() if k == "busy"} if key == "busy_mean" else None)
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
