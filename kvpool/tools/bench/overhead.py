"""`kvpool bench overhead`: what the pool costs when there is nothing to reuse.

A cold workload (every prompt new text, `disagg.py`'s presets) through the same engine twice,
alternating rounds (pool, no pool, pool, no pool, ...), the same prompts in both halves of a
round, fresh prompts every round:
- reference: a colocated worker with the pool (it looks every prompt up, stores every full chunk)
  vs the same worker with `--pool none` (it shares nothing), each behind a router of its own, the
  two pinned to the same cores (they never run at once);
- vllm (`--engine vllm`): a vLLM server with kvpool's connector (`kv_both`: it looks up and stores
  every prompt) vs a plain vLLM server, same flags otherwise, their own OpenAI APIs.
Each round sends `--requests` requests, at most `--concurrency` at a time (default one: a TTFT is
then the request's own service time, and its pair on the other side saw the same prompt). Reported
per engine: mean TTFT and output tokens/s, the no-pool run as the baseline, and the median and
quartiles of the paired ratios (LMCache's users measure a 3-15% loss on such workloads; the goal
here is within 3% for our worker, 5% for the vLLM connector).
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import click

from kvpool.tools.bench.disagg import requests_of, shape_of
from kvpool.tools.bench.report import Report, progress
from kvpool.tools.workload_file import preset_names


@click.command()
@click.option("--engine", "engines", multiple=True, type=click.Choice(["reference", "vllm"]),
              help="Engines to measure (default: reference; vllm needs .venv-vllm).")
@click.option("--workload", type=click.Choice(preset_names("bench disagg")), default="mixed", show_default=True,
              help="A `kvpool bench disagg` preset: its prompts' shape.")
@click.option("--rounds", type=int, default=6, show_default=True, help="Measured rounds (after one warm-up).")
@click.option("--requests", "n_requests", type=int, default=8, show_default=True, help="Requests per round.")
@click.option("--concurrency", type=int, default=1, show_default=True,
              help="Requests in flight at most (1: each TTFT is the request's own service time).")
@click.option("--cpus", default="0", show_default=True, help="Cores of both engines under test (one at a time).")
@click.option("--vllm-python", type=click.Path(dir_okay=False))
@click.option("--workdir", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True)
def overhead(engines, workload, rounds, n_requests, concurrency, cpus, vllm_python, workdir, as_json) -> None:
    """The pool on vs off on a workload with no reuse: TTFT and throughput, same run."""
    from reference_worker.cpus import parse

    cores = parse(cpus)
    workdir = Path(workdir or tempfile.mkdtemp(prefix="kvpool-bench-overhead-"))
    report = Report("overhead")
    shape = shape_of(workload)
    report.setup = {"workload": workload, **shape, "rounds": rounds, "requests": n_requests,
                    "concurrency": concurrency, "cpus": cpus}
    for engine in engines or ("reference",):
        with (_reference(workdir / "reference", cores) if engine == "reference"
              else _vllm(workdir / "vllm", cores, vllm_python)) as (pooled, plain):
            samples = _alternate(pooled, plain, shape, rounds, n_requests, concurrency, engine)
        prefix = "" if engine == "reference" else "vllm_"
        failed = {"failed": samples["pool"]["failed"], "failed_no_pool": samples["no_pool"]["failed"]}
        for metric, unit, case in (("ttft_ms", "ms", "ttft_mean_ms"), ("out_tok_per_s", "tok/s", "out_tok_per_s")):
            ours, theirs = samples["pool"][metric], samples["no_pool"][metric]
            # value and baseline: means over every request (TTFT) or round (tokens/s); the paired
            # ratios (same prompt, or same round, on both sides) say how sure the difference is
            report.add(f"{prefix}{case}/pool", [sum(ours) / len(ours)], unit, baseline="no_pool",
                       baseline_values=[sum(theirs) / len(theirs)],
                       extra={**_paired(ours, theirs, unit == "ms"), **failed})
    report.notes.append(f"cold {workload} workload {shape}; {rounds} rounds of {n_requests} requests "
                        f"(at most {concurrency} at once) per side, alternating; engines pinned to cores {cpus}; "
                        "goal: ratio >= 0.97 (reference), >= 0.95 (vllm)")
    report.emit(as_json)


def _alternate(pooled: str, plain: str, shape: dict[str, float], rounds: int, n: int, concurrency: int,
               label: str) -> dict[str, dict[str, list[float]]]:
    """Per side: every request's TTFT (ms, in the same order on both sides: the same prompts) and
    every round's output tokens/s."""
    from kvpool.tools.bench.serve_client import run_serve_bench

    out = {side: {"ttft_ms": [], "out_tok_per_s": [], "failed": 0} for side in ("pool", "no_pool")}
    bar, step = progress(2 * (rounds + 1), f"overhead ({label})")
    with bar:
        for r in range(rounds + 1):  # round 0 warms both up
            reqs = requests_of(shape, n, seed=1000 + r)
            order = (("pool", pooled), ("no_pool", plain)) if r % 2 else (("no_pool", plain), ("pool", pooled))
            for side, url in order:  # who goes first alternates too
                res = run_serve_bench(url, reqs, math.inf, max_concurrency=concurrency, label=side)
                if r:
                    out[side]["ttft_ms"] += [rec.ttft * 1e3 for rec in res.records]
                    out[side]["out_tok_per_s"].append(res.metrics.output_throughput)
                    out[side]["failed"] += res.metrics.failed
                step()
    return out


def _paired(ours: list[float], theirs: list[float], latency: bool) -> dict[str, float]:
    """Median and quartiles of the pairwise ratios (baseline / ours for a latency)."""
    import statistics

    ratios = sorted((b / a if latency else a / b) for a, b in zip(ours, theirs) if a > 0 and b > 0)
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return {"paired_ratio_median": round(statistics.median(ratios), 4), "paired_ratio_q1": round(q[0], 4),
            "paired_ratio_q3": round(q[2], 4), "pairs": len(ratios)}


class _reference:
    """A pool, a pooled and a pool-less colocated worker, a router for each; yields their /v1 URLs."""

    def __init__(self, workdir: Path, cores: list[int]):
        from reference_worker.cpus import format_list
        from kvpool.tools.launch.local import LocalCluster, WorkerSpec

        pin = ["--cpus", format_list(cores), "--prefill-chunk-tokens", "256"]
        self.cluster = LocalCluster(workdir, [WorkerSpec("both", "pooled", pin),
                                              WorkerSpec("both", "plain", ["--pool", "none", *pin])])
        self.routers: list = []

    def __enter__(self) -> tuple[str, str]:
        from kvpool.tools.bench.cluster import extra_router

        self.cluster.start()
        urls = []
        for name in ("pooled", "plain"):
            proc, url = extra_router(self.cluster, self.cluster.workdir, f"router-{name}", [],
                                     workers=[self.cluster.workers[name].url])
            self.routers.append(proc)
            urls.append(f"{url}/v1")
        return urls[0], urls[1]

    def __exit__(self, *exc) -> None:
        for proc in self.routers:
            proc.terminate()
            proc.wait(10)
        self.cluster.stop()


class _vllm:
    """A pool, a vLLM server with the kvpool connector and a plain one; yields their /v1 URLs."""

    def __init__(self, workdir: Path, cores: list[int], vllm_python: str | None):
        from kvpool.tools.bench.adapter_vllm import vllm_python as find_python
        from kvpool.tools.launch.vllm import check_python, reference_spec

        python = find_python(vllm_python)
        check_python(python)
        self.workdir, self.cores = workdir, cores
        self.spec = reference_spec(python=python, dtype="float32")
        self.procs: list = []

    def __enter__(self) -> tuple[str, str]:
        from kvpool.tools.launch.local import LocalCluster
        from kvpool.tools.launch.vllm import spawn_server, wait_healthy

        self.pool = LocalCluster(self.workdir, []).start()
        for name, address in (("vllm-pooled", self.pool.pool_address), ("vllm-plain", None)):
            self.procs.append(spawn_server(self.workdir, self.spec, name, "both", address, self.cores))
        for proc in self.procs:
            wait_healthy(proc, 900)
        return f"{self.procs[0].url}/v1", f"{self.procs[1].url}/v1"

    def __exit__(self, *exc) -> None:
        from kvpool.tools.launch.processes import reap, terminate

        for proc in self.procs:
            terminate(proc.popen)
        for proc in self.procs:
            reap(proc.popen, 15)
        self.pool.stop()
