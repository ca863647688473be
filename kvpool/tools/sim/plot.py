"""PNG plots of a run (`kvpool sim --plot`) and of a plan (`kvpool sim plan --plot`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvpool.tools.sim.engine import Simulation


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax: Any, values_ms: list[float], slo_ms: float, name: str) -> None:
    values = np.sort(values_ms)
    if len(values):
        ax.plot(values, np.arange(1, len(values) + 1) / len(values))
    ax.axvline(slo_ms, color="r", ls="--", lw=1, label="SLO")
    ax.set_xscale("log")
    ax.set_title(f"{name} CDF (ms)")
    ax.legend()


def plot_run(sim: Simulation, summary: dict[str, Any], points: list[dict[str, float]], path: Path) -> Path:
    plt = _plt()
    served = [f for f in sim.flights if f.t_done >= 0]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    _cdf(axes[0, 0], [(f.t_first - f.req.arrival_s) * 1e3 for f in served], summary["slo"]["ttft_ms"], "TTFT")
    _cdf(axes[0, 1], [(f.t_done - f.t_first) * 1e3 / (f.req.output_tokens - 1) for f in served
                      if f.req.output_tokens > 1], summary["slo"]["tbt_ms"], "TPOT")
    ax = axes[1, 0]
    if points:
        pts = sorted(points, key=lambda p: p["rate_rps"])
        ax.plot([p["rate_rps"] for p in pts], [p["attainment"] for p in pts], marker="o")
        ax.axhline(summary["slo"]["target"], color="r", ls="--", lw=1)
        if summary.get("goodput_rps"):
            ax.axvline(summary["goodput_rps"], color="g", ls=":", label=f"goodput {summary['goodput_rps']:.3g} req/s")
            ax.legend()
    ax.set_xscale("log")
    ax.set_xlabel("arrival rate (req/s)")
    ax.set_title("SLO attainment vs rate")
    ax = axes[1, 1]
    names = [i.name for i in sim.instances]
    span = max(summary["span_s"], 1e-9)
    ax.bar(range(len(names)), [i.busy_s / span for i in sim.instances],
           color=["tab:blue" if i.role == "prefill" else "tab:orange" if i.role == "decode" else "tab:green"
                  for i in sim.instances])
    ax.set_ylim(0, 1.05)
    ax.set_title("busy per instance (blue P, orange D, green colocated)")
    ax.set_xticks([])
    c = summary["config"]
    fig.suptitle(f"kvpool sim: {summary['requests']} requests, {c['profile']}, "
                 f"{c['colocated'] and str(c['colocated']) + ' colocated' or str(c['prefill']) + 'P/' + str(c['decode']) + 'D'}, "
                 f"{c['policy']}, hit ratio {summary['hit_ratio']:.3f}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_plan(rows: list[dict[str, Any]], best: dict[str, Any] | None, target: float, path: Path) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    ax = axes[0]
    for mix in sorted({r["mix"] for r in rows}):
        pts = sorted((r for r in rows if r["mix"] == mix), key=lambda r: r["cost_per_hour"])
        ax.plot([r["cost_per_hour"] for r in pts], [r["slo_attainment"] for r in pts], marker="o", ls="", label=mix)
    ax.axhline(target, color="r", ls="--", lw=1, label="target")
    if best is not None:
        ax.scatter([best["cost_per_hour"]], [best["slo_attainment"]], s=200, facecolors="none", edgecolors="k",
                   label="cheapest meeting targets")
    ax.set_xlabel("$ per hour (instances + DRAM)")
    ax.set_ylabel("SLO attainment")
    ax.set_title("attainment vs cost")
    ax.legend(fontsize=7)
    ax = axes[1]
    by_dram: dict[str, list[float]] = {}
    for r in rows:
        by_dram.setdefault(r["dram"], []).append(r["hit_ratio"])
    labels = list(by_dram)
    ax.plot(range(len(labels)), [max(by_dram[k]) for k in labels], marker="o")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels)
    ax.set_xlabel("pool DRAM")
    ax.set_ylabel("block hit ratio")
    ax.set_title("hit ratio vs capacity")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_study(doc: dict[str, Any], path: Path) -> Path:
    """Colocated vs disaggregated (TTFT mean, TTFT std, TBT p99, output throughput, busy) against
    load, one line per config; and the policies' TTFT p99."""
    plt = _plt()
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    metrics = (("ttft_ms", "mean", "TTFT mean (ms)"), ("ttft_ms", "std", "TTFT std (ms)"),
               ("tbt_ms", "p99", "TBT p99 (ms)"), ("throughput", "output_tok_per_s", "output tok/s"),
               ("slo_attainment", None, "SLO attainment"))
    base_rate = doc["workload"]["rate_rps"]
    for ax, (key, sub, title) in zip(axes.flat, metrics):
        for row in doc["colocated_vs_disaggregated"]:
            pts = sorted((float(k[1:]) * base_rate, v[key] if sub is None else v[key][sub])
                         for k, v in row["by_rate_scale"].items())
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=row["config"])
        ax.set_title(title)
        ax.set_xlabel("arrival rate (req/s)")
        ax.grid(alpha=0.3)
        if key == "ttft_ms":
            ax.set_yscale("log")  # an overloaded config is orders of magnitude off
    axes.flat[0].legend(fontsize=7)
    ax = axes.flat[5]
    for row in doc["policies"]:
        pts = sorted((float(k[1:]) * base_rate, v["ttft_ms"]["p99"]) for k, v in row["by_rate_scale"].items())
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{row['policy']} ({row['cache']})")
    ax.set_title("policies: TTFT p99 (ms)")
    ax.set_xlabel("arrival rate (req/s)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.suptitle(f"kvpool sim study: {doc['workload']['name']}, {doc['workload']['requests']} requests, {doc['profile']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
