"""What a soak measures and how it judges "flat": per-process resource samples from /proc, the
pool's shared-memory files in /dev/shm, and a verdict per (process, metric) series.

A series is judged over its second half (the first half is warm-up: the tiers fill up, caches
and thread pools reach their size). Two numbers describe its growth there:

- `rise`: the median of the window's last fifth minus the median of its first fifth (robust to
  the spikes of clients connecting and leaving);
- `growth`: the least-squares slope times the window's length (what a steady leak adds).

The series is flat when both stay within the metric's allowance (`TOLERANCES`):

- fds 4 + 2 per client, threads 2 + 1 per client: a connected client holds a connection (and
  its serving thread) at each server, and how many clients are connected at a sample wanders
  (a killed one is gone before its replacement has started), so these counts move by about the
  number of clients; a leak of one fd or thread per departed client grows by one per departure
  (over a hundred an hour here) and is far outside the band. The sharp check is `judge_idle`.
- shared-memory files 0.5 (no whole file may appear): the nodes' arenas and indexes are fixed.
- memory (VmRSS and its anonymous part, MiB) 2 + 8 per hour of window: an hour's run (a
  30-minute window) allows 6 MiB, so a steady leak above 12 MiB an hour fails (at 50
  operations a second, 70 bytes per operation); allocator noise (a MiB or two once the tiers
  are full) does not. A short run cannot resolve a rate, hence the constant.
"""

from __future__ import annotations

import os
import re
import statistics
from dataclasses import dataclass

SHM_DIR = "/dev/shm"
_POOL_SHM = re.compile(r"kvpool-(\d+)-[0-9a-f]+(\.idx)?")


@dataclass(frozen=True)
class Tolerance:
    absolute: float          # allowed growth over the judged window, in the metric's unit
    per_hour: float = 0.0    # plus this much per hour of window
    per_client: float = 0.0  # plus this much per load client alive at a time
    unit: str = ""

    def allowed(self, window_s: float, clients: int = 0) -> float:
        return self.absolute + self.per_hour * window_s / 3600.0 + self.per_client * clients


TOLERANCES: dict[str, Tolerance] = {
    "rss_mib": Tolerance(2.0, per_hour=8.0, unit="MiB"),
    "anon_mib": Tolerance(2.0, per_hour=8.0, unit="MiB"),
    "fds": Tolerance(4.0, per_client=2.0, unit="fds"),
    "threads": Tolerance(2.0, per_client=1.0, unit="threads"),
    "shm_files": Tolerance(0.5, unit="files"),
}


def sample_process(pid: int) -> dict[str, float] | None:
    """VmRSS, RssAnon, RssFile and RssShmem (MiB), open fds and threads of a live process; None when it is gone."""
    try:
        status = open(f"/proc/{pid}/status").read()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)

    def kib(name: str) -> float:
        return int(fields.get(name, "0 kB").split()[0]) / 1024.0

    # RssFile (the SSD tier's lmdb map, code) and RssShmem (/dev/shm arenas) are the rest of
    # VmRSS: recorded to explain a VmRSS change, bounded by the tiers' capacities.
    return {"rss_mib": round(kib("VmRSS"), 2), "anon_mib": round(kib("RssAnon"), 2),
            "file_mib": round(kib("RssFile"), 2), "shmem_mib": round(kib("RssShmem"), 2), "fds": fds,
            "threads": int(fields.get("Threads", "0"))}


def pool_shm_files(pids: set[int], directory: str = SHM_DIR) -> list[str]:
    """The pool's files in /dev/shm (`kvpool-<pid>-<hex>` arenas and their `.idx` indexes) made by
    one of `pids`: other pools on this machine (other tests) are not ours to count."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(n for n in names if (m := _POOL_SHM.fullmatch(n)) and int(m.group(1)) in pids)


def slope(ts: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over ts (units per second); 0 for fewer than 2 distinct times."""
    n = len(ts)
    if n < 2:
        return 0.0
    mt, my = statistics.fmean(ts), statistics.fmean(ys)
    var = sum((t - mt) ** 2 for t in ts)
    return 0.0 if var == 0 else sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var


def judge(ts: list[float], ys: list[float], metric: str, clients: int = 0, warmup: float = 0.5) -> dict:
    """The verdict on one series (times in seconds from the start): see the module docstring."""
    tol = TOLERANCES[metric]
    if not ts:
        return {"flat": False, "why": "no samples"}
    t_cut = ts[0] + warmup * (ts[-1] - ts[0])
    window = [(t, y) for t, y in zip(ts, ys) if t >= t_cut]
    if len(window) < 5:
        return {"flat": False, "why": f"{len(window)} samples after warm-up (need 5)"}
    wt, wy = [t for t, _ in window], [y for _, y in window]
    fifth = max(1, len(window) // 5)
    rise = statistics.median(wy[-fifth:]) - statistics.median(wy[:fifth])
    per_s = slope(wt, wy)
    span = wt[-1] - wt[0]
    growth = per_s * span
    allowed = tol.allowed(span, clients)
    flat = rise <= allowed and growth <= allowed
    return {"flat": flat, "start": ys[0], "warm": wy[0], "end": ys[-1], "min": min(ys), "max": max(ys),
            "rise": round(rise, 3), "growth": round(growth, 3), "slope_per_hour": round(per_s * 3600.0, 3),
            "allowed": round(allowed, 3), "unit": tol.unit, "window_s": round(span, 1),
            "why": "" if flat else f"grew {max(rise, growth):.2f} {tol.unit} in {span:.0f}s "
                                   f"(allowed {allowed:.2f})"}


def judge_idle(before: dict[str, dict], after: dict[str, dict], fds: int = 2, threads: int = 2) -> list[dict]:
    """Compare two samples of the servers taken with no client connected (mid-run and at the end):
    whatever the clients that came and went in between left behind shows here, without the noise
    of live connections. A server's idle fds/threads may differ by at most `fds`/`threads`."""
    out = []
    for name, b in before.items():
        a = after.get(name)
        if a is None:
            out.append({"process": name, "ok": False, "why": "gone at the end"})
            continue
        dfd, dth = a["fds"] - b["fds"], a["threads"] - b["threads"]
        ok = dfd <= fds and dth <= threads
        out.append({"process": name, "ok": ok, "fds": [b["fds"], a["fds"]], "threads": [b["threads"], a["threads"]],
                    "why": "" if ok else f"idle fds {b['fds']}->{a['fds']}, threads {b['threads']}->{a['threads']}"})
    return out


def plot(samples: list[dict], processes: list[str], path: str, title: str) -> None:
    """Every metric against time, one line per server process; shm files and operations below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = ["rss_mib", "anon_mib", "fds", "threads"]
    fig, axes = plt.subplots(3, 2, figsize=(12, 10), sharex=True)
    ts = [s["t"] / 60.0 for s in samples]
    for ax, metric in zip(axes.flat, metrics):
        for name in processes:
            ys = [s["procs"].get(name, {}).get(metric) for s in samples]
            ax.plot(ts, [float("nan") if y is None else y for y in ys], label=name, lw=1)
        ax.set_title(metric)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, ncol=2)
    axes[2][0].plot(ts, [s["shm_files"] for s in samples], color="k")
    axes[2][0].set_title("pool files in /dev/shm")
    axes[2][1].plot(ts, [s["ops"] for s in samples], label="operations")
    axes[2][1].plot(ts, [s["errors"] for s in samples], label="errors")
    axes[2][1].plot(ts, [s["killed"] for s in samples], label="clients SIGKILLed")
    axes[2][1].set_yscale("symlog")
    axes[2][1].legend(fontsize=7)
    axes[2][1].set_title("cumulative")
    for ax in axes[2]:
        ax.set_xlabel("minutes")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
