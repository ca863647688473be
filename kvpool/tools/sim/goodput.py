"""DistServe's goodput: the highest arrival rate at which at least `target` of the requests meet
both SLOs. Found by scaling the workload's arrival times (the same requests, faster or slower):
double or halve from the run's own rate until the answer is bracketed, then bisect (geometric).

Attainment is not strictly monotone in rate for a finite trace (a faster replay can reorder
cache fills), so the search reports every point it ran; the answer is the highest passing rate
below the lowest failing one that it found.
"""

from __future__ import annotations

from typing import Any, Callable


def goodput_search(run: Callable[[float], dict[str, Any]], base_rate: float, target: float,
                   first: dict[str, Any] | None = None, steps: int = 6,
                   on_step: Callable[[], None] | None = None,
                   known: dict[float, float] | None = None) -> tuple[float | None, list[dict[str, float]]]:
    """`run(scale)` simulates the workload at `scale` x its rate and returns its summary.
    `known`: attainment already measured at some scales (no need to run them again).
    Returns (goodput in req/s or None when not even the slowest tried rate passes, the points)."""
    points: list[dict[str, float]] = [{"rate_scale": k, "rate_rps": k * base_rate, "attainment": v}
                                      for k, v in sorted((known or {}).items())]

    def attain(scale: float, summary: dict[str, Any] | None = None) -> bool:
        summary = summary if summary is not None else run(scale)
        if on_step is not None and summary is not first:
            on_step()
        points.append({"rate_scale": scale, "rate_rps": scale * base_rate, "attainment": summary["slo_attainment"]})
        return summary["slo_attainment"] >= target

    if steps <= 0:
        return None, points
    lo: float | None = None  # highest passing scale
    hi: float | None = None  # lowest failing scale
    scale, summary, left = 1.0, first, steps + (1 if first is not None else 0)
    if known:
        passing = [k for k, v in known.items() if v >= target]
        lo = max(passing) if passing else None
        failing = [k for k, v in known.items() if v < target and (lo is None or k > lo)]
        hi = min(failing) if failing else None
        scale = hi / 2 if lo is None else lo * 2 if hi is None else (lo * hi) ** 0.5
        summary, left = None, steps
    while left > 0:
        left -= 1
        if attain(scale, summary):
            lo = scale if lo is None else max(lo, scale)
        else:
            hi = scale if hi is None else min(hi, scale)
        summary = None
        if lo is not None and hi is not None and lo > hi:  # not monotone: keep the bracket below hi
            lo = None
        scale = hi / 2 if lo is None else lo * 2 if hi is None else (lo * hi) ** 0.5
    return (None if lo is None else lo * base_rate), points
