"""`kvpool sim calibrate`: measure this machine's reference workers and fit the `local` profile.

`kvpool sim calibrate` starts a real pool and two real workers (one prefill, one decode; each
pinned to a core of its own with one torch thread, as `kvpool bench disagg` runs them; no local
prefix cache so cached prefixes come from the pool); `measure` calls them directly over HTTP:
- prefill: prompts of c new tokens after k tokens already in the pool; the worker reports
  `compute_ms`, `fetch_ms` and `push_ms` (`kvpool.worker_api.PrefillResponse`). The router's
  own fitter (`CostModel`) gives p0, p_tok, p_attn; fetch and push rates are bytes / time.
- decode: B sequences of L-token prompts decoded together (one forward per step, the batched
  engine); the time between the tokens the client receives (the engine's step plus streaming
  each token out, which shares the worker's core and its GIL with the step) is fitted,
  non-negative least squares, as step = d_weights + d_seq*B + d_kv*(KV tokens in the batch):
  the fixed part is what every step pays (on a CPU, reading the weights), which a colocated
  step shares with the prefill chunk it carries (`fused`). The engine-only step time
  (`kvpool_worker_decode_step_seconds`) is kept in the samples for comparison.
- the control hop: a prefill's wall time seen by the caller minus the `prefill_ms` it reports.
Only the CLI starts the processes (it alone sees `engine_adapters`). It takes a few minutes on
two cores; the machine should be otherwise quiet.
"""

from __future__ import annotations

import random
import re
import statistics
import threading
import time
from typing import Any

import httpx
import numpy as np

from kvpool import worker_api as wire
from kvpool.tools.bench.report import progress
from kvpool.errors import Unavailable
from kvpool.router.cost import CostModel, _nnls3
from kvpool.tools.sim.profile import Profile

PREFILL_GRID = ((64, 0), (256, 0), (512, 0), (1024, 0), (64, 1024), (256, 1024), (512, 512))  # (computed, cached)
# (batch, prompt tokens): batch 1 at four contexts separates the per-KV-token cost and the
# hand-off's fixed and per-byte parts; batches 4 to 16 the per-sequence term
DECODE_GRID = ((1, 64), (1, 512), (1, 1024), (1, 1536), (4, 256), (4, 1024), (8, 256), (8, 1024), (16, 256),
               (16, 512))
DECODE_TOKENS = 16
NO_BYTE_COST = 1e15  # bytes/s of a hand-off whose time shows no per-byte part
_METRIC = re.compile(r"^(kvpool_worker_decode_(?:step_seconds|batch_size)_(?:sum|count)) (\S+)$", re.M)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def _decode_metrics(url: str) -> dict[str, float]:
    return {k: float(v) for k, v in _METRIC.findall(httpx.get(f"{url}/metrics", timeout=10).text)}


class _Worker:
    """The two worker calls calibration needs, over plain HTTP (`kvpool.worker_api` messages)."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(600.0, connect=10.0))

    def prefill(self, ids: list[int]) -> wire.PrefillResponse:
        resp = self.http.post("/v1/prefill", content=wire.encode(wire.PrefillRequest(token_ids=ids)),
                              headers={"content-type": "application/json"})
        if resp.status_code >= 400:
            raise Unavailable(f"prefill on {self.url} failed: HTTP {resp.status_code} {resp.text[:200]}")
        return wire.decode(resp.content, wire.PrefillResponse)

    def decode(self, head: wire.PrefillResponse, max_tokens: int, out: list[float]) -> None:
        """Stream a decode to its end (no stop tokens: exactly `max_tokens`); appends to `out` the
        mean time between the tokens the client received (streaming included)."""
        msg = wire.DecodeRequest(handle=head.handle, first_token=head.first_token, max_tokens=max_tokens,
                                 stop_token_ids=[])
        stamps = [time.perf_counter()]
        with self.http.stream("POST", "/v1/decode", content=wire.encode(msg),
                              headers={"content-type": "application/json"}) as resp:
            for line in resp.iter_lines():
                if line.strip():
                    event = wire.decode(line, wire.TokenEvent)
                    if event.error is not None:
                        raise Unavailable(f"decode on {self.url} failed: {event.error.message}")
                    if event.token_id >= 0:
                        stamps.append(time.perf_counter())
        if len(stamps) > 3:  # [sent, first token, ...]: the first gap is KV load + join + one step
            out.append(((stamps[-1] - stamps[2]) / (len(stamps) - 3), stamps[1] - stamps[0]))

    def close(self) -> None:
        self.http.close()


def measure(prefill_url: str, decode_url: str, repeats: int = 2) -> tuple[dict[str, Any], int]:
    """Calibration samples from a running prefill worker and decode worker (started with one
    torch thread and no local cache), and the model's KV bytes per token."""
    rng = random.Random("kvpool-sim-calibrate")
    samples: dict[str, Any] = {"prefill": [], "decode": [], "hop_ms": []}
    pre, dec = _Worker(prefill_url), _Worker(decode_url)
    try:
        bpt = int(httpx.get(f"{pre.url}/v1/info", timeout=10).json()["bytes_per_token"])
        pre.prefill(_tokens(rng, 32))  # warm-up: the first forward pays one-off costs
        bar, step = progress((len(PREFILL_GRID) + len(DECODE_GRID)) * repeats, "calibrating")
        with bar:
            for computed, cached in PREFILL_GRID:
                for _ in range(repeats):
                    prefix = _tokens(rng, cached)
                    if cached:
                        pre.prefill(prefix)  # its full chunks are now in the pool
                    started = time.perf_counter()
                    r = pre.prefill(prefix + _tokens(rng, computed))
                    wall_ms = (time.perf_counter() - started) * 1e3
                    samples["prefill"].append({
                        "computed": r.computed_tokens, "cached": r.cached_tokens, "compute_ms": r.compute_ms,
                        "fetch_ms": r.fetch_ms, "push_ms": r.push_ms, "prefill_ms": r.prefill_ms,
                        "fetched_bytes": r.pool_cached_tokens * bpt,
                        "pushed_bytes": (r.prompt_tokens - r.pool_cached_tokens) * bpt})
                    samples["hop_ms"].append(max(0.0, wall_ms - r.prefill_ms))
                    step()
            for batch, length in [g for g in DECODE_GRID for _ in range(repeats)]:
                heads = [pre.prefill(_tokens(rng, length)) for _ in range(batch)]
                before = _decode_metrics(dec.url)
                gaps: list[tuple[float, float]] = []
                threads = [threading.Thread(target=dec.decode, args=(h, DECODE_TOKENS, gaps)) for h in heads]
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
                                              "client_tbt_ms": statistics.fmean(g[0] for g in gaps) * 1e3 if gaps else None,
                                              "open_ms": statistics.fmean(g[1] for g in gaps) * 1e3 if gaps else None,
                                              "kv_bytes": length * bpt,
                                              "steps": steps, "prompt": length})
                step()
    finally:
        pre.close()
        dec.close()
    return samples, bpt


def fit(samples: dict[str, Any], bytes_per_token: int) -> Profile:
    """The `local` profile from calibration samples (also used by tests on recorded samples)."""
    cost = CostModel(min_samples=3)
    for s in samples["prefill"]:
        cost.observe_prefill(s["computed"], s["cached"], s["compute_ms"] / 1e3)
    p = cost.params()
    fetch = [s["fetched_bytes"] / (s["fetch_ms"] / 1e3) for s in samples["prefill"] if s["fetched_bytes"] and s["fetch_ms"] > 0]
    push = [s["pushed_bytes"] / (s["push_ms"] / 1e3) for s in samples["prefill"] if s["pushed_bytes"] and s["push_ms"] > 0]
    dec = samples["decode"]
    d_weights = d_seq = d_kv = 0.0
    if dec:
        # what a client sees between tokens (the engine step plus streaming it out), where measured
        x = np.array([[1.0, s["batch"], s["kv_tokens"]] for s in dec])
        t = np.array([(s.get("client_tbt_ms") or s["step_ms"]) / 1e3 for s in dec])
        coef = _nnls3(x, t)
        if coef is not None:
            d_weights, d_seq, d_kv = (float(c) for c in coef)
    fetch_rate = statistics.median(fetch) if fetch else 1e9
    pull_fixed, pull_rate = _fit_open(dec, samples["hop_ms"])
    return Profile(
        name="local", description="calibrated from this machine's reference workers (kvpool sim calibrate, "
                                  f"{time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())})",
        p0=p.prefill_fixed_s, p_tok=p.prefill_token_s, p_attn=p.prefill_attn_s, p_floor=0.0,
        d0=0.0, d_seq=d_seq, d_weights=d_weights, d_kv=d_kv, d_tok=0.0, fused=True, prefill_chunk_tokens=256,
        bytes_per_token=bytes_per_token, link_bytes_per_s=fetch_rate,
        pull_bytes_per_s=pull_rate or fetch_rate, pull_fixed_s=pull_fixed, dram_read_bytes_per_s=fetch_rate,
        ssd_read_bytes_per_s=fetch_rate, push_bytes_per_s=statistics.median(push) if push else 1e9,
        rpc_s=statistics.median(samples["hop_ms"]) / 1e3 if samples["hop_ms"] else 0.002,
        max_batch=32, max_kv_tokens=65536, price_per_hour=0.0, cards=0, card="cpu (1 pinned core, 1 torch thread)",
        model="SmolLM2-135M-Instruct (float32)")


def _fit_open(dec: list[dict[str, Any]], hop_ms: list[float]) -> tuple[float, float]:
    """The hand-off of a prompt's KV to a decode worker, from the batch-1 decodes: their open (send
    to the first decoded token) less one step (the client's time between tokens) and one control
    hop is fitted, non-negative least squares, as fixed + bytes / rate. Returns (fixed s, rate
    bytes/s; 0 where no per-byte cost shows). A single rate through the origin would charge the
    fixed part (admission, the handle check, the pool pin; ~70 ms here) to every byte."""
    hop = statistics.median(hop_ms) / 1e3 if hop_ms else 0.0
    pts = [(s["kv_bytes"], (s["open_ms"] - s["client_tbt_ms"]) / 1e3 - hop) for s in dec
           if s["batch"] <= 1.01 and s.get("open_ms") and s.get("client_tbt_ms")]
    if not pts:
        return 0.0, 0.0
    x = np.array([[1.0, b, 0.0] for b, _ in pts])
    coef = _nnls3(x, np.array([max(0.0, t) for _, t in pts]))
    if coef is None:
        return 0.0, 0.0
    fixed, per_byte = float(coef[0]), float(coef[1])
    return fixed, (1.0 / per_byte if per_byte > 0 else NO_BYTE_COST)

