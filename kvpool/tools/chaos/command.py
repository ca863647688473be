"""`kvpool chaos`: run a chaos campaign on a real cluster on loopback and check what the pool promises."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import click
from pydantic import Field, PositiveFloat, PositiveInt

from kvpool.tools.workload_file import WorkloadFile, takes_workload


class ChaosWorkload(WorkloadFile):
    """`kvpool chaos`'s keys; the defaults are the `campaign` preset (RELIABILITY.md)."""

    seed: int = Field(1, description="Seed of the fault schedule and of the load.")
    duration: PositiveFloat = Field(600.0, description="Seconds of faults under load.")
    min_faults: int = Field(100, ge=0, description="Keep injecting past duration (up to 3x) until this many faults.")
    clients: PositiveInt = Field(4, description="Load client processes.")
    rate: PositiveFloat = Field(25.0, description="Operations per second per client.")


@takes_workload("chaos", ChaosWorkload)
@click.command()
@click.option("--seed", type=int, help="Seed of the fault schedule and of the load (key seed).")
@click.option("--duration", type=float, help="Seconds of faults under load (key duration).")
@click.option("--rate", type=float, help="Operations per second per client (key rate).")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where logs, operation records and data go (default: a new temporary directory, kept).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the full report (every fault, every violation) here.")
@click.option("--netns", is_flag=True,
              help="Run the cluster across network namespaces (root): every process in its own, every fault a "
                   "partition (nft cuts: master/etcd, node/master, one-way cuts ...).")
def chaos(workload: ChaosWorkload, workdir: Path | None, json_path: Path | None, netns: bool) -> None:
    """Faults under load: SIGKILL/SIGSTOP of nodes and of the leading master, etcd restarts,
    cut/delayed/blackholed links, a full SSD disk; then every operation and every key checked.

    Exits 1 when a promise was broken (see kvpool.tools.chaos.checker). The same --seed replays the
    same fault schedule."""
    from kvpool.tools.chaos.campaign import run_campaign

    seed, duration, min_faults, clients, rate = (workload.seed, workload.duration, workload.min_faults,
                                                 workload.clients, workload.rate)
    workdir = workdir or Path(tempfile.mkdtemp(prefix="kvpool-chaos-"))
    where = " across network namespaces" if netns else ""
    click.echo(f"chaos campaign{where}, seed {seed}, {duration:.0f}s, at least {min_faults} faults; logs in {workdir}")
    try:
        report = run_campaign(workdir, seed=seed, duration_s=duration, min_faults=min_faults, clients=clients,
                              rate=rate, netns=netns)
    except RuntimeError as exc:  # the cluster could not start (no etcd, a service that did not come up)
        raise click.ClickException(f"{exc} (logs in {workdir})") from None
    path = json_path or workdir / "report.json"
    path.write_text(json.dumps(report, indent=1, default=str))
    click.echo(summary(report))
    click.echo(f"full report: {path}")
    if report["violations"]:
        raise SystemExit(1)


def summary(r: dict) -> str:
    lines = [f"seed {r['seed']}: {r['duration_s']}s, {len(r['faults'])} faults, {r['ops_checked']} operations checked "
             f"({r['acked_puts']} acknowledged puts, {r['sweep_ok']}/{r['swept']} read back at the end), "
             f"{len(r['violations'])} violations {r['violation_counts']}",
             f"load average {r['load_average']} on {r['cpus']} CPUs; {r['disk']}; "
             f"master evictions {r['master_evictions']}",
             f"misses explained by faults {r['misses_explained_by_faults']}, "
             f"lost with their nodes {r['lost_with_their_nodes']}",
             f"{'fault':<24}{'count':>6}{'serve p50':>11}{'serve max':>11}{'back p50':>10}{'back max':>10}"]
    for kind, row in r["fault_summary"].items():
        s, b = row["serve_s"], row["recover_s"]
        lines.append(f"{kind:<24}{row['count']:>6}{_f(s['p50']):>11}{_f(s['max']):>11}"
                     f"{_f(b['p50']):>10}{_f(b['max']):>10}")
    if r["crashes"]:
        lines.append(f"processes that died by themselves: {[(c['name'], c['returncode']) for c in r['crashes']]}")
    for v in r["violations"][:20]:
        lines.append(f"VIOLATION {v['kind']}: {v['why']} {json.dumps(v['op'], default=str)[:300]}")
    return "\n".join(lines)


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"
