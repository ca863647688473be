"""`kvpool sim study`: the issue's questions on one trace, each answered by simulation runs, as one
JSON document (BENCHMARKS.md "The simulator" is made from it).

- reuse: the trace's reuse upper bound vs the simulated hit ratio with unlimited capacity, at
  several arrival rates (a block is usable only once its prefill stored it);
- global vs local: one pool shared by all prefill instances vs each its own share of the same
  total capacity;
- policies: cache_aware vs round_robin vs least_loaded, TTFT and goodput;
- colocated vs disaggregated: at equal instance count and at equal cost (prefill and decode on
  different cards), at several loads.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from kvpool.tools.sim.engine import SimConfig, Simulation
from kvpool.tools.sim.goodput import goodput_search
from kvpool.tools.sim.results import summarize
from kvpool.tools.sim.workload import Workload

KEEP = ("hit_ratio", "token_hit_ratio", "slo_attainment", "ttft_ms", "tbt_ms", "tpot_ms", "throughput", "busy",
        "busy_min_max", "cost", "decisions", "rejected", "sim_wall_s")


class Study:
    def __init__(self, workload: Workload, slo: tuple[float, float, float], goodput_steps: int = 6,
                 on_run: Callable[[str], None] | None = None):
        self.workload = workload
        self.slo = slo
        self.goodput_steps = goodput_steps
        self.on_run = on_run or (lambda label: None)
        self.runs = 0

    def run(self, cfg: SimConfig, scale: float = 1.0, label: str = "") -> dict[str, Any]:
        self.on_run(label)
        self.runs += 1
        return summarize(Simulation(self.workload.scaled(scale), cfg).run(), *self.slo)

    def goodput(self, cfg: SimConfig, rows: dict[str, dict[str, Any]], label: str = "") -> float | None:
        """The search starts from the load rows already run (keys "x<scale>")."""
        known = {float(k[1:]): v["slo_attainment"] for k, v in rows.items()}
        found, _ = goodput_search(lambda s: self.run(cfg, s, label), self.workload.rate, self.slo[2],
                                  steps=self.goodput_steps, known=known)
        return None if found is None else round(found, 4)

    @staticmethod
    def keep(summary: dict[str, Any]) -> dict[str, Any]:
        return {k: summary[k] for k in KEEP}

    # -- the questions -------------------------------------------------------------------------------
    def reuse(self, base: SimConfig, scales: tuple[float, ...]) -> list[dict[str, Any]]:
        out = []
        for scale in scales:
            s = self.run(replace(base, dram_bytes=None), scale, f"reuse x{scale:g}")
            out.append({"rate_scale": scale, "rate_rps": round(self.workload.rate * scale, 4),
                        "upper_bound": s["reuse_upper_bound"], "simulated": {
                            "hit_ratio": s["hit_ratio"], "token_hit_ratio": s["token_hit_ratio"]}})
        return out

    def global_vs_local(self, base: SimConfig, capacities: list[tuple[str, int]]) -> list[dict[str, Any]]:
        out = []
        for label, cap in capacities:
            g = self.run(replace(base, dram_bytes=cap, cache="global"), 1.0, f"global {label}")
            loc = self.run(replace(base, dram_bytes=cap, cache="local"), 1.0, f"local {label}")
            out.append({"capacity": label, "bytes": cap, "global": self.keep(g), "local": self.keep(loc),
                        "hit_ratio_ratio": round(g["hit_ratio"] / loc["hit_ratio"], 3) if loc["hit_ratio"] else None})
        return out

    def policies(self, base: SimConfig, scales: tuple[float, ...]) -> list[dict[str, Any]]:
        out = []
        for policy in ("cache_aware", "round_robin", "least_loaded"):
            cfg = replace(base, policy=policy)
            rows = {f"x{scale:g}": self.keep(self.run(cfg, scale, f"{policy} x{scale:g}")) for scale in scales}
            out.append({"policy": policy, "cache": base.cache, "dram_bytes": base.dram_bytes, "by_rate_scale": rows,
                        "goodput_rps": self.goodput(cfg, rows, label=f"{policy} goodput")})
        return out

    def colocated_vs_disaggregated(self, configs: dict[str, SimConfig], scales: tuple[float, ...]) -> list[dict[str, Any]]:
        out = []
        for name, cfg in configs.items():
            rows = {f"x{scale:g}": self.keep(self.run(cfg, scale, f"{name} x{scale:g}")) for scale in scales}
            out.append({"config": name, "instances": cfg.instances, "by_rate_scale": rows,
                        "goodput_rps": self.goodput(cfg, rows, label=f"{name} goodput")})
        return out
