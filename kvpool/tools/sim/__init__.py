"""`kvpool sim`: a discrete-event model of a serving cluster (prefill, decode or colocated
instances, the pool's tiers and links) driven by Mooncake-format traces, running the real router
policies (`kvpool.router.policy`) and eviction policies (`kvpool.tiers.policy`) unchanged.

    workload.py   requests: Mooncake traces, synthetic sessions, tokenized bench workloads
    profile.py    timing of prefill, decode steps and KV movement (JSON; `local` is calibrated)
    roofline.py   GPU profiles from FLOPs and HBM bandwidth
    calibrate.py  measures this machine's reference workers into the `local` profile
    pool.py       the pool's DRAM / SSD tiers with a real eviction policy
    instance.py   one instance's scheduler (decode-priority continuous batching)
    engine.py     the event loop, the request's life, the router's decision
    results.py    hit ratios, TTFT / TBT, SLO attainment, busy, cost
    goodput.py    DistServe's goodput by a rate search
    plan.py       the capacity planner's sweep
    plot.py       PNGs
"""

from __future__ import annotations

from typing import Any

from kvpool.tools.sim.engine import SimConfig, Simulation
from kvpool.tools.sim.results import summarize
from kvpool.tools.sim.workload import Workload

__all__ = ["SimConfig", "Simulation", "Workload", "simulate", "summarize"]


def simulate(workload: Workload, config: SimConfig, slo_ttft_s: float, slo_tbt_s: float,
             slo_target: float = 0.9) -> dict[str, Any]:
    """Run once and summarize."""
    return summarize(Simulation(workload, config).run(), slo_ttft_s, slo_tbt_s, slo_target)
