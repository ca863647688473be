"""The shared-memory arena: attach from another process, and no RAM leaked by a dead node."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from kvpool.errors import InvalidArgument
from kvpool.shm.arena import SharedArena

CREATOR = r"""
import sys, time
from kvpool.shm.arena import SharedArena
a = SharedArena.create(1 << 20)
a.buffer[:5] = b"hello"
print(a.path, flush=True)
time.sleep(60)
"""


def test_stale_arena_of_a_killed_node_is_reaped(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    child = subprocess.Popen([sys.executable, "-c", CREATOR], stdout=subprocess.PIPE, text=True, env=env)
    try:
        path = child.stdout.readline().strip()
        os.utime(path, (0, 0))  # old enough to be considered
        assert path not in SharedArena.reap_stale(), "a live node's arena must never be reaped"
        attached = SharedArena.attach(path)
        assert bytes(attached.buffer[:5]) == b"hello"
        attached.close()
        assert os.path.exists(path)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        child.stdout.close()
    assert os.path.exists(path)  # kill -9: nobody unlinked it
    assert path in SharedArena.reap_stale()
    assert not os.path.exists(path)


def test_own_arena_is_not_reaped_and_young_files_are_left_alone():
    arena = SharedArena.create(1 << 16)
    try:
        os.utime(arena.path, (0, 0))
        assert arena.path not in SharedArena.reap_stale()
        assert os.path.exists(arena.path)
    finally:
        arena.close()
    assert not os.path.exists(arena.path)


def test_bad_names_and_paths():
    with pytest.raises(InvalidArgument):
        SharedArena.create(4096, name="../etc/x")
    with pytest.raises(InvalidArgument):
        SharedArena.attach("/dev/shm/kvpool-does-not-exist")
    arena = SharedArena.create(4096, name=f"kvpool-test-{os.getpid()}")
    try:
        with pytest.raises(InvalidArgument):
            SharedArena.create(4096, name=f"kvpool-test-{os.getpid()}")
    finally:
        arena.close()


def test_an_index_left_without_its_arena_by_a_dead_node_is_reaped(tmp_path):
    """Regression (the soak): removing a killed node's arena but not its `.idx` left the index in
    /dev/shm forever, since reaping went by arenas only."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = tmp_path / f"kvpool-{dead.pid}-0badc0de.idx"
    live_owner = tmp_path / f"kvpool-{os.getpid()}-0badc0de.idx"  # this process lives
    with_arena = tmp_path / f"kvpool-{dead.pid}-1badc0de.idx"
    young = tmp_path / f"kvpool-{dead.pid}-2badc0de.idx"
    for p in (orphan, live_owner, with_arena, young, tmp_path / f"kvpool-{dead.pid}-1badc0de"):
        p.write_bytes(b"x")
        if p is not young:
            os.utime(p, (0, 0))
    removed = SharedArena.reap_stale(str(tmp_path))
    # the dead node's arena (no flock holder) goes with its index; the orphan goes too
    assert sorted(removed) == sorted([str(orphan), str(tmp_path / f"kvpool-{dead.pid}-1badc0de")])
    assert not orphan.exists() and not with_arena.exists()
    assert live_owner.exists() and young.exists()
