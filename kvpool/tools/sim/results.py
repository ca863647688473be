"""What a simulation run reports: hit ratios, per-tier traffic, TTFT / TBT / TPOT distributions,
SLO attainment, busy fractions, throughput and cost. One flat JSON-able dict.

Definitions:
- `hit_ratio`: prompt blocks served from cache / all prompt blocks (prefix hits only: a block
  counts only if every block before it in the prompt was a hit); `token_hit_ratio` likewise in
  tokens.
- `tbt_ms`: the time between consecutive tokens of a sequence, over every generated token (a
  decode step's time, or a step plus the prefill chunk a colocated instance ran next to it);
  `tpot_ms`: per request, (last token - first token) / (tokens - 1), as `vllm bench serve`.
- `slo_attainment`: fraction of all requests (refused ones fail) with TTFT <= the TTFT SLO and
  TPOT <= the TBT SLO (DistServe's pair of SLOs).
- `attained_rps`: requests meeting both SLOs per second of the run (vLLM's "goodput");
  `goodput_rps` (DistServe's goodput: the highest arrival rate at which `slo_target` of requests
  meet both) comes from a rate search, see `goodput.py`.
- `busy`: per instance role, seconds computing / the run's span (first arrival to last token).
- cost: instance-hours over the span at the profiles' prices; per million prompt+output tokens
  and per million output tokens.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import numpy as np

from kvpool.tools.sim.engine import Simulation
from kvpool.tools.sim.workload import reuse_upper_bound


def _dist(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "std": None, "p50": None, "p90": None, "p99": None}
    arr = np.asarray(values) * 1e3
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"mean": round(float(arr.mean()), 3), "std": round(float(arr.std()), 3), "p50": round(float(p50), 3),
            "p90": round(float(p90), 3), "p99": round(float(p99), 3)}


def _weighted_dist(values: list[float], weights: list[int]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    v = np.asarray(values) * 1e3
    w = np.asarray(weights, dtype=np.float64)
    order = np.argsort(v)
    v, w = v[order], w[order]
    cum = np.cumsum(w) / w.sum()

    def q(p: float) -> float:
        return round(float(v[min(len(v) - 1, int(np.searchsorted(cum, p)))]), 3)

    return {"mean": round(float((v * w).sum() / w.sum()), 3), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99)}


def summarize(sim: Simulation, slo_ttft_s: float, slo_tbt_s: float, slo_target: float = 0.9) -> dict[str, Any]:
    flights = sim.flights
    cfg = sim.config
    served = [f for f in flights if f.t_done >= 0]
    ttft = [f.t_first - f.req.arrival_s for f in served]
    tpot = [(f.t_done - f.t_first) / (f.req.output_tokens - 1) for f in served if f.req.output_tokens > 1]
    ok = sum(1 for f in served if f.t_first - f.req.arrival_s <= slo_ttft_s and (
        f.req.output_tokens <= 1 or (f.t_done - f.t_first) / (f.req.output_tokens - 1) <= slo_tbt_s))
    start = min((f.req.arrival_s for f in flights), default=0.0)
    end = max((f.t_done for f in served), default=start)
    span = max(end - start, 1e-9)
    blocks = sum(len(f.req.blocks) for f in flights)
    tokens = sum(f.req.prompt_tokens for f in flights)
    hit_blocks = sum(f.hit_blocks for f in flights)
    hit_tokens = sum(min(f.req.prompt_tokens, f.hit_blocks * sim.block_tokens) for f in flights)
    out_tokens = sum(f.req.output_tokens for f in served)
    in_tokens = sum(f.req.prompt_tokens for f in served)
    kinds: dict[str, int] = {}
    for f in flights:
        kinds[f.kind] = kinds.get(f.kind, 0) + 1
    busy: dict[str, list[float]] = {}
    for inst in sim.instances:
        busy.setdefault(inst.role, []).append(inst.busy_s / span)
    price_h = sum(inst.profile.price_per_hour for inst in sim.instances)
    cost = price_h * span / 3600
    upper = reuse_upper_bound(sim.workload.requests, sim.block_tokens)
    traffic: dict[str, int] = {}
    pools = [sim.pool] if sim.pool is not None else [i.cache for i in sim.instances if i.cache is not None]
    for pool in pools:
        for k, v in pool.traffic().items():
            traffic[k] = traffic.get(k, 0) + v
    prof = cfg.profile
    return {
        "requests": len(flights), "completed": len(served), "rejected": len(flights) - len(served),
        "config": {"prefill": cfg.prefill, "decode": cfg.decode, "colocated": cfg.colocated,
                   "profile": prof.name, "decode_profile": (cfg.decode_profile or prof).name,
                   "dram_bytes": cfg.dram_bytes, "ssd_bytes": cfg.ssd_bytes, "eviction": cfg.eviction,
                   "policy": cfg.policy, "cache": cfg.cache, "block_tokens": sim.block_tokens,
                   "local_prefill_tokens": cfg.local_prefill_tokens},
        "offered_rps": round(sim.workload.rate, 4) if math.isfinite(sim.workload.rate) else None,
        "hit_ratio": round(hit_blocks / blocks, 5) if blocks else 0.0,
        "token_hit_ratio": round(hit_tokens / tokens, 5) if tokens else 0.0,
        "reuse_upper_bound": {"hit_ratio": round(upper[0], 5), "token_hit_ratio": round(upper[1], 5)},
        "ttft_ms": _dist(ttft), "tpot_ms": _dist(tpot),
        "tbt_ms": _weighted_dist(sim.tbt_values, sim.tbt_weights),
        "e2e_ms": _dist([f.t_done - f.req.arrival_s for f in served]),
        "slo": {"ttft_ms": slo_ttft_s * 1e3, "tbt_ms": slo_tbt_s * 1e3, "target": slo_target},
        "slo_attainment": round(ok / len(flights), 5) if flights else 0.0,
        "attained_rps": round(ok / span, 5),
        "goodput_rps": None,
        "throughput": {"req_per_s": round(len(served) / span, 5), "output_tok_per_s": round(out_tokens / span, 3),
                       "total_tok_per_s": round((in_tokens + out_tokens) / span, 3)},
        "busy": {role: round(statistics.fmean(v), 4) for role, v in busy.items()},
        "busy_min_max": {role: [round(min(v), 4), round(max(v), 4)] for role, v in busy.items()},
        "decisions": kinds,
        "traffic": traffic,
        "span_s": round(span, 3),
        "cost": {"per_hour": round(price_h, 3), "total": round(cost, 4),
                 "per_m_tokens": round(cost / ((in_tokens + out_tokens) / 1e6), 5) if in_tokens + out_tokens else None,
                 "per_m_output_tokens": round(cost / (out_tokens / 1e6), 5) if out_tokens else None},
        "sim_wall_s": round(sim.wall_s, 3),
    }
