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


def _child_keyring(env: dict[str, str]) -> list:
    """[keyring directory, on] as a child process started with `env` sees them."""
    out = subprocess.run([sys.executable, "-c", "import json; from kvpool.security import local; "
                          "print(json.dumps([str(local.local_dir()), local.enabled()]))"],
                         env=env, capture_output=True, text=True, timeout=60, check=True).stdout
    return __import__("json").loads(out)


def test_clean_env_children_find_the_keyring_their_launcher_uses(tmp_path, monkeypatch):
    """A launcher clears its children's KVPOOL_* settings, but they must use its own per-user
    keyring (or none), however it was told which: here by a config file, which the children do
    not get (KVPOOL_CONFIG is one of the cleared settings)."""
    from kvpool.tools.launch.processes import clean_env

    for name in [k for k in os.environ if k.startswith("KVPOOL_")]:
        monkeypatch.delenv(name)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[security]\nlocal_dir = "{tmp_path / "mine"}"\n')
    monkeypatch.setenv("KVPOOL_CONFIG", str(cfg))
    assert _child_keyring(clean_env()) == [str(tmp_path / "mine"), True]
    off = tmp_path / "off.toml"  # another file: this process reads its tree again when a variable changes
    off.write_text("[security]\nlocal_auth = false\n")
    monkeypatch.setenv("KVPOOL_CONFIG", str(off))
    assert _child_keyring(clean_env())[1] is False
    assert _child_keyring(clean_env(KVPOOL_LOCAL_AUTH="on"))[1] is True  # what the caller gives wins
