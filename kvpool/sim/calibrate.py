"""`kvpool sim calibrate`: measure this machine's reference workers and fit the `local` profile.

It starts a real pool and two real workers (one prefill, one decode; one torch thread each, no
local prefix cache so cached prefixes come from the pool) and calls them directly:
- prefill: prompts of c new tokens after k tokens already in the pool; the worker reports
  `compute_ms`, `fetch_ms` and `push_ms` (`kvpool.worker_api.PrefillResponse`). The router's
  own fitter (`CostModel`) gives p0, p_tok, p_attn; fetch and push rates are bytes / time.
- decode: B sequences of L-token prompts decoded together; the worker's metrics give the step
  time and batch size (`kvpool_worker_decode_step_seconds`, `..._decode_batch_size`); a
  non-negative least-squares fit gives step = d0 + d_seq*B + d_kv*(KV tokens in the batch).
- the control hop: a prefill's wall time seen by the caller minus the `prefill_ms` it reports.
Like `kvpool bench disagg` this is a CLI face that starts processes (imports `engine_adapters`
on use). It takes a few minutes on two cores; the machine should be otherwise quiet.
"""

from __future__ import annotations

import random
import re
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from kvpool.bench.report import progress
from kvpool.router.cost import CostModel, _nnls3
from kvpool.sim.profile import Profile

PREFILL_GRID = ((64, 0), (256, 0), (512, 0), (1024, 0), (64, 1024), (256, 1024), (512, 512))  # (computed, cached)
DECODE_GRID = ((1, 64), (1, 1024), (2, 64), (4, 64), (4, 512))  # (batch, prompt tokens)
DECODE_TOKENS = 12
_METRIC = re.compile(r"^(kvpool_worker_decode_(?:step_seconds|batch_size)_(?:sum|count)) (\S+)$", re.M)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def _decode_metrics(url: str) -> dict[str, float]:
    return {k: float(v) for k, v in _METRIC.findall(httpx.get(f"{url}/metrics", timeout=10).text)}


def run_calibration(workdir: Path | None = None, repeats: int = 2) -> tuple[Profile, dict[str, Any]]:
    from engine_adapters.serving.client import WorkerClient
    from engine_adapters.serving.launcher import LocalCluster, WorkerSpec

    workdir = workdir or Path(tempfile.mkdtemp(prefix="kvpool-sim-calibrate-"))
    args = ["--threads", "1", "--local-cache", "0"]
    cluster = LocalCluster(workdir, [WorkerSpec("prefill", "prefill-0", list(args)),
                                     WorkerSpec("decode", "decode-0", list(args))]).start()
    rng = random.Random("kvpool-sim-calibrate")
    samples: dict[str, Any] = {"prefill": [], "decode": [], "hop_ms": []}
    try:
        pre, dec = WorkerClient(cluster.url("prefill-0")), WorkerClient(cluster.url("decode-0"))
        info = httpx.get(f"{cluster.url('prefill-0')}/v1/info", timeout=10).json()
        bpt = int(info["bytes_per_token"])
        pre.prefill(_tokens(rng, 32))  # warm-up: first forward pays one-off costs
        bar, step = progress(len(PREFILL_GRID) * repeats + len(DECODE_GRID), "calibrating")
        with bar:
            for computed, cached in PREFILL_GRID:
                for _ in range(repeats):
                    prefix = _tokens(rng, cached)
                    if cached:
                        pre.prefill(prefix)  # its full chunks are now in the pool
                    ids = prefix + _tokens(rng, computed)
                    started = time.perf_counter()
                    r = pre.prefill(ids)
                    wall_ms = (time.perf_counter() - started) * 1e3
                    samples["prefill"].append({
                        "computed": r.computed_tokens, "cached": r.cached_tokens, "compute_ms": r.compute_ms,
                        "fetch_ms": r.fetch_ms, "push_ms": r.push_ms, "prefill_ms": r.prefill_ms,
                        "fetched_bytes": r.pool_cached_tokens * bpt,
                        "pushed_bytes": (r.prompt_tokens - r.pool_cached_tokens) * bpt})
                    samples["hop_ms"].append(max(0.0, wall_ms - r.prefill_ms))
                    step()
            for batch, length in DECODE_GRID:
                heads = [pre.prefill(_tokens(rng, length)) for _ in range(batch)]
                before = _decode_metrics(dec.url)
                threads = [threading.Thread(target=lambda h=h: list(dec.decode(h.handle, h.first_token, DECODE_TOKENS,
                                                                                 stop_token_ids=[])))
                           for h in heads]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                after = _decode_metrics(dec.url)
                d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
                steps = d.get("kvpool_worker_decode_step_seconds_count", 0.0)
                if steps:
                    mean_batch = d["kvpool_worker_decode_batch_size_sum"] / d["kvpool_worker_decode_batch_size_count"]
                    samples["decode"].append({"batch": mean_batch, "kv_tokens": mean_batch * (length + DECODE_TOKENS / 2),
                                              "step_ms": d["kvpool_worker_decode_step_seconds_sum"] / steps * 1e3,
                                              "steps": steps, "prompt": length})
                step()
        pre.close()
        dec.close()
    finally:
        cluster.stop()
    return fit(samples, bpt), samples


def fit(samples: dict[str, Any], bytes_per_token: int) -> Profile:
    """The `local` profile from calibration samples (also used by tests on recorded samples)."""
    cost = CostModel(min_samples=3)
    for s in samples["prefill"]:
        cost.observe_prefill(s["computed"], s["cached"], s["compute_ms"] / 1e3)
    p = cost.params()
    fetch = [s["fetched_bytes"] / (s["fetch_ms"] / 1e3) for s in samples["prefill"] if s["fetched_bytes"] and s["fetch_ms"] > 0]
    push = [s["pushed_bytes"] / (s["push_ms"] / 1e3) for s in samples["prefill"] if s["pushed_bytes"] and s["push_ms"] > 0]
    dec = samples["decode"]
    d0 = d_seq = d_kv = 0.0
    if dec:
        x = np.array([[1.0, s["batch"], s["kv_tokens"]] for s in dec])
        t = np.array([s["step_ms"] / 1e3 for s in dec])
        coef = _nnls3(x, t)
        if coef is not None:
            d0, d_seq, d_kv = (float(c) for c in coef)
    fetch_rate = statistics.median(fetch) if fetch else 1e9
    return Profile(
        name="local", description="calibrated from this machine's reference workers (kvpool sim calibrate, "
                                  f"{time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())})",
        p0=p.prefill_fixed_s, p_tok=p.prefill_token_s, p_attn=p.prefill_attn_s, p_floor=0.0,
        d0=d0, d_seq=d_seq, d_weights=0.0, d_kv=d_kv, d_tok=0.0, fused=False, prefill_chunk_tokens=512,
        bytes_per_token=bytes_per_token, link_bytes_per_s=fetch_rate, dram_read_bytes_per_s=fetch_rate,
        ssd_read_bytes_per_s=fetch_rate, push_bytes_per_s=statistics.median(push) if push else 1e9,
        rpc_s=statistics.median(samples["hop_ms"]) / 1e3 if samples["hop_ms"] else 0.002,
        max_batch=32, max_kv_tokens=65536, price_per_hour=0.0, cards=0, card="cpu (1 torch thread)",
        model="SmolLM2-135M-Instruct (float32)")
