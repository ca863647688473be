"""Giving each worker cores of its own: CPU lists (`0-3,6`), pinning a process, and a plan that
hands out a machine's cores to workers.

Colocated and disaggregated runs compare fairly only on equal cores: two workers left to the
kernel's scheduler share every core, and one worker's prefill then slows the other's decode
(issue 25 measured a decode server's ITL p99 at 10.7 s that way). A pinned worker runs torch
with as many threads as it has cores. The router and the pool are not pinned: they share
whatever cores there are (their CPU time is small next to a model's; `kvpool bench disagg`
reports it).
"""

from __future__ import annotations

import itertools
import os

from kvpool.errors import InvalidArgument


def parse(text: str) -> list[int]:
    """`"0-2,5"` -> [0, 1, 2, 5]; refuses empty lists, bad ranges and cores this machine lacks."""
    cores: set[int] = set()
    try:
        for part in text.split(","):
            part = part.strip()
            lo, _, hi = part.partition("-")
            first, last = int(lo), int(hi or lo)
            if first < 0 or last < first:
                raise ValueError(part)
            cores.update(range(first, last + 1))
    except ValueError:
        raise InvalidArgument(f"bad CPU list {text!r}: use numbers and ranges, e.g. 0-3,6") from None
    usable = os.sched_getaffinity(0)
    if not cores or not cores <= usable:
        raise InvalidArgument(f"CPU list {text!r} names cores this process cannot use (it may use "
                              f"{format_list(sorted(usable))})")
    return sorted(cores)


def format_list(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> `"0-2,5"`."""
    runs = [[c for _, c in run] for _, run in itertools.groupby(enumerate(cores), lambda ic: ic[1] - ic[0])]
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def pin(cores: list[int], threads: int | None = None) -> int:
    """Pin this process to `cores` and run torch with `threads` (default: one per core); the count."""
    os.sched_setaffinity(0, cores)
    import torch

    count = threads or len(cores)
    torch.set_num_threads(count)
    return count


def plan(workers: int, per_worker: int, available: list[int] | None = None) -> list[list[int]]:
    """Cores for each of `workers` workers, `per_worker` each, in order; disjoint while the machine
    has enough, and `InvalidArgument` when it has not (sharing would defeat the point)."""
    cores = sorted(available if available is not None else os.sched_getaffinity(0))
    if per_worker < 1:
        raise InvalidArgument("cores per worker must be at least 1")
    need = workers * per_worker
    if need > len(cores):
        raise InvalidArgument(f"{workers} workers x {per_worker} cores need {need} cores; this machine has "
                              f"{len(cores)} ({format_list(cores)})")
    return [cores[i * per_worker:(i + 1) * per_worker] for i in range(workers)]
