"""CPU lists and the plan that gives each worker cores of its own (`kvpool up --cpus-per-worker`,
`kvpool bench disagg`'s cpus_per_worker), and a worker process that pins itself."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from reference_worker.cpus import format_list, parse, plan
from kvpool.errors import InvalidArgument


def test_lists_round_trip_and_bad_ones_are_refused():
    usable = sorted(os.sched_getaffinity(0))
    assert parse(format_list(usable)) == usable
    assert format_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    for bad in ("", "a", "3-1", "-1", f"{max(usable) + 1}"):
        with pytest.raises(InvalidArgument):
            parse(bad)


def test_plan_gives_disjoint_cores_in_order_or_refuses():
    assert plan(2, 1, [0, 1]) == [[0], [1]]
    assert plan(2, 2, [0, 1, 2, 3, 4]) == [[0, 1], [2, 3]]
    with pytest.raises(InvalidArgument, match="need 3 cores"):
        plan(3, 1, [0, 1])
    with pytest.raises(InvalidArgument):
        plan(1, 0, [0, 1])


def test_a_pinned_process_runs_on_its_core_with_one_thread():
    core = sorted(os.sched_getaffinity(0))[-1]
    code = ("import os, torch; from reference_worker.cpus import pin, parse; "
            f"n = pin(parse('{core}')); print(sorted(os.sched_getaffinity(0)), n, torch.get_num_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [f"[{core}]", "1", "1"]
