"""`kvpool sim plan`: sweep pool capacities and instance mixes over one workload, and pick the
cheapest configuration that meets the SLO-attainment and hit-ratio targets.

A mix is `NP/MD` (N prefill + M decode instances) or `Kc` (K colocated). Cost per hour is the
instances' price plus the pool's DRAM (`dram_price_gb_hour` per GB; unlimited DRAM has no price
and is there as the ceiling of the hit-ratio curve, never a recommendation).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from kvpool.errors import InvalidArgument
from kvpool.tools.sim.engine import SimConfig, Simulation
from kvpool.tools.sim.results import summarize
from kvpool.tools.sim.workload import Workload


def parse_mix(text: str) -> tuple[int, int, int]:
    """'4P/12D' -> (4, 12, 0); '16c' -> (0, 0, 16)."""
    t = text.strip().lower()
    try:
        if t.endswith("c"):
            return 0, 0, int(t[:-1])
        p, d = t.split("/")
        return int(p.rstrip("p")), int(d.rstrip("d")), 0
    except ValueError:
        raise InvalidArgument(f"not an instance mix: {text!r} (use e.g. 4P/12D or 16c)") from None


def mix_name(p: int, d: int, c: int) -> str:
    return f"{c}c" if c else f"{p}P/{d}D"


def sweep(workload: Workload, base: SimConfig, mixes: list[str], drams: list[tuple[str, int | None]],
          slo_ttft_s: float, slo_tbt_s: float, slo_target: float, dram_price_gb_hour: float,
          on_step: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    rows = []
    for mix in mixes:
        p, d, c = parse_mix(mix)
        for label, dram in drams:
            cfg = replace(base, prefill=p, decode=d, colocated=c, dram_bytes=dram)
            s = summarize(Simulation(workload, cfg).run(), slo_ttft_s, slo_tbt_s, slo_target)
            dram_cost = 0.0 if dram is None else dram / 1e9 * dram_price_gb_hour
            rows.append({"mix": mix_name(p, d, c), "dram": label, "dram_bytes": dram,
                         "cost_per_hour": round(s["cost"]["per_hour"] + dram_cost, 4),
                         "slo_attainment": s["slo_attainment"], "hit_ratio": s["hit_ratio"],
                         "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p99_ms": s["ttft_ms"]["p99"],
                         "tbt_p99_ms": s["tbt_ms"]["p99"], "busy": s["busy"],
                         "cost_per_m_tokens": s["cost"]["per_m_tokens"]})
            if on_step is not None:
                on_step()
    return rows


def cheapest(rows: list[dict[str, Any]], slo_target: float, min_hit_ratio: float) -> dict[str, Any] | None:
    ok = [r for r in rows if r["dram_bytes"] is not None and r["slo_attainment"] >= slo_target
          and r["hit_ratio"] >= min_hit_ratio]
    return min(ok, key=lambda r: (r["cost_per_hour"], -r["slo_attainment"])) if ok else None
