"""`kvpool soak`: a long mixed load on a real cluster on loopback while clients come and go
abruptly; the servers' memory, fds, threads and /dev/shm files must stay flat."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import click


@click.command()
@click.option("--duration", default=3600.0, show_default=True, help="Seconds of load.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Where soak.json (every sample and verdict) and soak.png (metrics against time) go.")
@click.option("--name", default="soak", show_default=True, help="File name stem of the JSON and the plot.")
@click.option("--seed", default=1, show_default=True, help="Seed of the load and of the kill schedule.")
@click.option("--sample", "sample_s", default=10.0, show_default=True, help="Seconds between samples.")
@click.option("--clients", default=4, show_default=True, help="Load client processes alive at a time.")
@click.option("--rate", default=12.0, show_default=True, help="Operations per second per client.")
@click.option("--kill-every", "kill_every_s", default=20.0, show_default=True,
              help="Mean seconds between client SIGKILLs (each waits until its victim is mid-operation).")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Logs, operation records and data (default: a new temporary directory, kept).")
def soak(duration: float, out_dir: Path, name: str, seed: int, sample_s: float, clients: int, rate: float,
         kill_every_s: float, workdir: Path | None) -> None:
    """Soak: etcd, 2 masters and 3 nodes (DRAM + SSD) under put/get/match_prefix/remove from
    client processes that are SIGKILLed mid-operation or exit cleanly and are replaced.

    Samples each server's RSS, open fds and threads and the pool's /dev/shm files; judges each
    series over its second half (see kvpool.tools.chaos.leaks for the allowances). Exits 1 when
    anything grew, a server died or a read was wrong."""
    from kvpool.tools.chaos.leaks import plot
    from kvpool.tools.chaos.soak import run_soak, summary

    out_dir.mkdir(parents=True, exist_ok=True)
    workdir = workdir or Path(tempfile.mkdtemp(prefix="kvpool-soak-"))
    click.echo(f"soak, seed {seed}, {duration:.0f}s, {clients} clients at {rate:g} op/s; logs in {workdir}")

    def progress(s: dict, total: float) -> None:
        done = min(1.0, s["t"] / total)
        bar = "#" * int(30 * done)
        rss = sum(p["rss_mib"] for p in s["procs"].values())
        fds = sum(p["fds"] for p in s["procs"].values())
        click.echo(f"\r[{bar:<30}] {s['t']:5.0f}/{total:.0f}s ops {s['ops']} err {s['errors']} "
                   f"killed {s['killed']} | servers rss {rss:.0f}MiB fds {fds} shm {s['shm_files']} "
                   f"load {s['load1']:.1f}  ", nl=False)

    try:
        report = run_soak(workdir, duration_s=duration, seed=seed, sample_s=sample_s, clients=clients, rate=rate,
                          kill_every_s=kill_every_s, progress=progress)
    except RuntimeError as exc:  # the cluster could not start
        raise click.ClickException(f"{exc} (logs in {workdir})") from None
    click.echo()
    json_path, png_path = out_dir / f"{name}.json", out_dir / f"{name}.png"
    json_path.write_text(json.dumps(report, indent=1, default=str))
    t = report["totals"]
    plot(report["samples"], list(report["server_pids"]), str(png_path),
         f"kvpool soak, seed {seed}, {report['run_s']:.0f}s: {t['ops']} ops, {t['killed']} clients SIGKILLed, "
         f"{t['clean_exits']} clean exits; {'flat' if report['ok'] else 'FAILED'}")
    click.echo(summary(report))
    click.echo(f"report: {json_path}\nplot: {png_path}")
    if not report["ok"]:
        raise SystemExit(1)
