"""The one shape every `kvpool bench` reports in (see shared BENCH.md).

Ours and the baseline are measured alternately (ours, baseline, ours, baseline, ...) after a
warm-up, so both see the same machine noise; the median is the value and (min, max) the spread.
`ratio` is ours/baseline for throughput and baseline/ours for latency: higher is always better.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

LATENCY_UNITS = {"s", "ms", "us", "ns"}


@dataclass
class Result:
    case: str
    value: float
    unit: str
    size: int | None = None
    baseline: str | None = None
    baseline_value: float | None = None
    ratio: float | None = None
    spread: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        if not doc["extra"]:
            doc.pop("extra")
        return doc


def ratio(value: float, baseline_value: float | None, unit: str) -> float | None:
    if baseline_value is None or value <= 0 or baseline_value <= 0:
        return None
    r = baseline_value / value if unit in LATENCY_UNITS else value / baseline_value
    return round(r, 3)


def alternate(ours: Callable[[], float], baseline: Callable[[], float] | None, reps: int = 5,
              warmup: int = 1, on_rep: Callable[[], None] | None = None) -> tuple[list[float], list[float]]:
    """Run `ours` and `baseline` alternately `reps` times after `warmup` rounds; each returns a figure."""
    for _ in range(warmup):
        ours()
        if baseline is not None:
            baseline()
    mine: list[float] = []
    base: list[float] = []
    for _ in range(reps):
        mine.append(ours())
        if baseline is not None:
            base.append(baseline())
        if on_rep is not None:
            on_rep()
    return mine, base


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def timed(fn: Callable[[], Any]) -> float:
    """Seconds `fn` takes (perf_counter)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Report:
    """Collects results; prints a table (rich) and, with `--json`, one JSON object last."""

    def __init__(self, bench: str):
        self.bench = bench
        self.results: list[Result] = []
        self.notes: list[str] = []
        self.setup: dict[str, Any] = {}  # how the run was set up, as data (what a reader rebuilds it from)

    def add(self, case: str, values: list[float], unit: str, *, size: int | None = None,
            baseline: str | None = None, baseline_values: list[float] | None = None,
            extra: dict[str, Any] | None = None) -> Result:
        value = statistics.median(values)
        base_value = statistics.median(baseline_values) if baseline_values else None
        result = Result(
            case=case, size=size, value=round(value, 4), unit=unit, baseline=baseline,
            baseline_value=None if base_value is None else round(base_value, 4),
            ratio=ratio(value, base_value, unit),
            spread=[round(min(values), 4), round(max(values), 4)], extra=extra or {},
        )
        self.results.append(result)
        return result

    def document(self) -> dict[str, Any]:
        from kvpool import __version__

        return {
            "bench": self.bench,
            "version": __version__,
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "platform": platform.platform(terse=True),
                        "load": [round(x, 2) for x in os.getloadavg()]},
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "results": [r.to_json() for r in self.results],
            **({"notes": self.notes} if self.notes else {}),
            **({"setup": self.setup} if self.setup else {}),
        }

    def emit(self, as_json: bool) -> None:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"kvpool bench {self.bench}")
        for col in ("case", "size", "value", "unit", "baseline", "baseline value", "ratio", "spread"):
            table.add_column(col)
        for r in self.results:
            table.add_row(r.case, _size(r.size), f"{r.value:g}", r.unit, r.baseline or "-",
                          "-" if r.baseline_value is None else f"{r.baseline_value:g}",
                          "-" if r.ratio is None else f"{r.ratio:.2f}", f"{r.spread[0]:g}..{r.spread[1]:g}")
        Console(file=sys.stdout if not as_json else sys.stderr).print(table)
        for note in self.notes:
            print(f"note: {note}", file=sys.stderr if as_json else sys.stdout)
        if as_json:
            sys.stdout.write(json.dumps(self.document()) + "\n")
            sys.stdout.flush()


def _size(size: int | None) -> str:
    if size is None:
        return "-"
    for unit, factor in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= factor and size % factor == 0:
            return f"{size // factor} {unit}"
    return str(size)


def progress(total: int, description: str):
    """A rich progress bar on stderr (stdout stays clean for `--json`)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=Console(file=sys.stderr), transient=True)
    task = bar.add_task(description, total=total)
    return bar, (lambda: bar.advance(task))
