"""`kvpool.tools.launch.processes.spawn`: a child lives as long as its launcher process, not as
long as the thread that started it (PR_SET_PDEATHSIG fires when the forking *thread* ends: the
chaos cluster, which starts its services one thread each, lost all of them at start-up)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

from kvpool.tools.launch.processes import spawn, stop


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_child_outlives_the_thread_that_spawned_it():
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("p", spawn(["sleep", "60"])))
    t.start()
    t.join()
    child = box["p"]
    try:
        time.sleep(0.5)  # PDEATHSIG, if it came, came when the thread ended
        assert child.poll() is None, f"the child died with its spawning thread (exit {child.returncode})"
    finally:
        stop(child, 2)


def test_a_child_still_dies_with_its_launcher_process():
    launcher = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import threading, time
        from kvpool.tools.launch.processes import spawn
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("p", spawn(["sleep", "60"])))
        t.start(); t.join()
        print(box["p"].pid, flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True, env={**os.environ})
    pid = int(launcher.stdout.readline())
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not _gone(pid):
        os.kill(pid, 9)
        raise AssertionError("the child outlived its SIGKILLed launcher")
