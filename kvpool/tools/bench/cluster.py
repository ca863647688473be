"""What the cluster-level benches share: starting a local cluster, reading the workers' and the
router's counters, running a workload through the OpenAI API, and one run's table row.

The benches themselves: `policies.py` (`kvpool bench policies`) and `disagg.py` (`kvpool bench
disagg`, the seed's table).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import click
import httpx

from kvpool.security.keyring import AUTH_FILE_ENV, load_keyring
from kvpool.security.http_guard import internal_headers

_BUSY = re.compile(r"^kvpool_worker_(?:decode_step|prefill_chunk)_seconds_sum (\S+)$", re.M)
_PROMPT = re.compile(r'^kvpool_worker_prompt_tokens_total\{source="(\w+)"\} (\S+)$', re.M)
_PREFILLS = re.compile(r'^kvpool_worker_requests_total\{kind="prefill"\} (\S+)$', re.M)
_LOCAL_TOKENS = re.compile(r"^kvpool_worker_local_cache_tokens (\S+)$", re.M)
_DECISIONS = re.compile(r'^kvpool_router_decisions_total\{[^}]*kind="(\w+)"[^}]*\} (\S+)$', re.M)


def cpu_seconds(pid: int) -> float:
    """CPU time a process and its live descendants have used so far (user + system, all their
    threads), from /proc: a vLLM server's engine core runs in a child process."""
    stats: dict[int, tuple[int, float]] = {}  # pid -> (parent, seconds)
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            except OSError:  # gone meanwhile
                continue
            stats[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += stats.get(p, (0, 0.0))[1]
        todo += [child for child, (parent, _) in stats.items() if parent == p]
    return total


def busy_seconds(url: str) -> float:
    return sum(float(v) for v in _BUSY.findall(httpx.get(f"{url}/metrics", timeout=10).text))


def start_cluster(workdir: Path, roles: list[str], router_args: list[str],
                  worker_args: list[str] | Callable[[int, str], list[str]], pool_args: list[str] = (),
                  start: bool = True):
    """A pool, workers of `roles` and a router; `worker_args`: every worker's extra flags, or a
    function of (index, role) giving each its own. Started unless `start` is False."""
    from kvpool.tools.launch.local import LocalCluster, PoolSpec, RouterSpec, WorkerSpec

    args_of = worker_args if callable(worker_args) else (lambda i, role: list(worker_args))
    specs = [WorkerSpec(role, f"{role}-{i}", args_of(i, role)) for i, role in enumerate(roles)]
    cluster = LocalCluster(workdir, specs, pool=PoolSpec(args=list(pool_args)), router=RouterSpec(args=router_args))
    return cluster.start() if start else cluster


def worker_counters(cluster) -> dict[str, dict[str, float]]:
    """Per worker: prefills done and prompt tokens by source (local, pool, computed), cumulative."""
    out = {}
    for name, proc in cluster.workers.items():
        text = httpx.get(f"{proc.url}/metrics", timeout=10).text
        row = {src: float(v) for src, v in _PROMPT.findall(text)}
        row["prefills"] = sum(float(v) for v in _PREFILLS.findall(text))
        out[name] = row
    return out


def counter_delta(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, Any]:
    """What one run did: prefills per worker, and prompt tokens by source over all workers."""
    per_worker = {n: int(after[n].get("prefills", 0) - before[n].get("prefills", 0)) for n in after}
    tokens = {src: int(sum(after[n].get(src, 0) - before[n].get(src, 0) for n in after))
              for src in ("local", "pool", "computed")}
    total = sum(tokens.values())
    return {"prefills_by_worker": per_worker, "prompt_tokens_by_source": tokens,
            "hit_ratio": (tokens["local"] + tokens["pool"]) / total if total else None}


def internal(cluster) -> dict[str, str]:
    """Headers for the router's /admin and /metrics (its internal token, with a keyring)."""
    return internal_headers(load_keyring(getattr(cluster, "env", os.environ).get(AUTH_FILE_ENV)))


def local_knowledge(cluster, router_url: str, chunk_tokens: int = 256) -> dict[str, list[int]]:
    """Per worker: [local chunks the router knows of from its KV events, chunks the worker holds]."""
    listed = httpx.get(f"{router_url}/admin/workers", timeout=10, headers=internal(cluster)).json()["workers"]
    known = {w["url"]: w["local_cache_chunks"] for w in listed}
    out = {}
    for name, proc in cluster.workers.items():
        held = sum(float(v) for v in _LOCAL_TOKENS.findall(httpx.get(f"{proc.url}/metrics", timeout=10).text))
        out[name] = [known.get(proc.url, -1), int(held) // chunk_tokens]
    return out


def router_decisions(cluster) -> dict[str, float]:
    """The router's routing decisions so far, by kind (disaggregated, local_prefill, colocated, ...)."""
    text = httpx.get(f"{cluster.router_url}/metrics", timeout=10, headers=internal(cluster)).text
    out: dict[str, float] = {}
    for kind, value in _DECISIONS.findall(text):
        out[kind] = out.get(kind, 0.0) + float(value)
    return out


def extra_router(cluster, workdir: Path, name: str, args: list[str],
                 workers: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    """One more router over `workers` (URLs; default: every worker of the cluster) and its URL."""
    from kvpool.tools.launch.local import KVPOOL

    ready = workdir / f"{name}.ready"
    urls = workers if workers is not None else [p.url for p in cluster.workers.values()]
    workers = [x for url in urls for x in ("--worker", url)]
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


def clear_caches(cluster) -> None:
    for proc in cluster.workers.values():
        httpx.post(f"{proc.url}/v1/cache/clear", timeout=30)


def run_workload(base_url: str, requests: list, rate: float, slos: dict[str, float], label: str) -> Any:
    from kvpool.tools.bench.serve_client import run_serve_bench

    return run_serve_bench(base_url, requests, rate, slos_ms=slos, label=label, seed=int(rate * 1000))


def row_of(res: Any) -> dict[str, Any]:
    m = res.metrics
    return {"completed": m.completed, "failed": m.failed, "ttft_mean_ms": m.ttft.mean,
            "ttft_std_ms": m.ttft.std, "ttft_p99_ms": m.ttft.p99, "tpot_mean_ms": m.tpot.mean,
            "tpot_p99_ms": m.tpot.p99, "itl_p99_ms": m.itl.p99, "e2e_p99_ms": m.e2e.p99,
            "req_per_s": m.request_throughput, "out_tok_per_s": m.output_throughput, "goodput": m.goodput,
            "mean_cached_tokens": m.mean_cached_tokens, "duration_s": m.duration_s, "errors": m.errors[:3]}


def slos_of(goodput: tuple[str, ...]) -> dict[str, float]:
    from kvpool.tools.bench.serve_metrics import parse_slo

    return dict(parse_slo(g) for g in goodput)


