"""Child processes, one way for everyone: `kvpool up`, the benches, the chaos campaigns and the
tests start `kvpool` subcommands (and etcd, vLLM, redis) through here.

`spawn` starts a command in its own session with its output in a log file and, on Linux, a
SIGTERM if the parent dies (PR_SET_PDEATHSIG), so a killed launcher leaves no orphans; `stop`
sends SIGTERM, waits `grace_s`, then SIGKILL. `free_port` is a free loopback TCP port (bound and
released: another process may take it first, which callers that can bind port 0 avoid).

PR_SET_PDEATHSIG fires when the *thread* that forked the child ends, not the process: a child
started from a short-lived thread (the chaos cluster starts its services in parallel, one thread
each) got SIGTERM as soon as that thread returned. So a child spawned off the main thread is
forked by one long-lived spawner thread, which ends only with the process.

`clean_env` is the environment of a child that must not inherit our `KVPOOL_*` settings.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Callable, Collection, Sequence, TypeVar

from kvpool.security.local import child_env

T = TypeVar("T")

log = logging.getLogger(__name__)

# `kvpool` as this interpreter runs it: works without the console script on PATH, and a
# PYTHONPATH checkout runs its own code.
KVPOOL = [sys.executable, "-c", "from kvpool.cli import main; main()"]

try:  # resolved here, not in the child: after fork only the plain call is safe
    _PRCTL = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except (OSError, AttributeError):
    _PRCTL = None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: SIGTERM when the launcher dies


def clean_env(**settings: str) -> dict[str, str]:
    """This process's environment without its `KVPOOL_*` settings, plus `settings`; but it says
    where this user's own keyring is and whether it is on, as this process sees it
    (`kvpool.security.local.child_env`), because a child that found another keyring than ours (or
    none) could not talk to us, nor we to it."""
    return {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")} | child_env() | settings


def child_pids(pid: int) -> set[int]:
    """The processes `pid` started that still run (Linux: /proc/<pid>/task/*/children)."""
    out: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out |= {int(p) for p in f.read().split()}
        except FileNotFoundError:  # a thread that just ended
            pass
    return out


def pin_process(pid: int, cores: Collection[int]) -> set[int]:
    """Pin every thread of `pid` to `cores` (threads and processes it starts later inherit the
    mask); the cores it is allowed afterwards, as the kernel reads them back."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(task), cores)
        except (ProcessLookupError, FileNotFoundError):  # a thread that just ended
            pass
    return os.sched_getaffinity(pid)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_requests: "queue.SimpleQueue[tuple[Callable[[], object], Future]]" = queue.SimpleQueue()
_spawner: threading.Thread | None = None
_spawner_lock = threading.Lock()


def _serve_requests() -> None:
    while True:
        fn, future = _requests.get()
        try:
            future.set_result(fn())
        except BaseException as exc:  # handed to the caller
            future.set_exception(exc)


def _on_lasting_thread(fn: Callable[[], T]) -> T:
    """Run `fn` (a fork) on a thread that lives as long as the process (see the module doc)."""
    global _spawner
    if threading.current_thread() is threading.main_thread():
        return fn()
    with _spawner_lock:
        if _spawner is None:
            _spawner = threading.Thread(target=_serve_requests, name="kvpool-spawner", daemon=True)
            _spawner.start()
    future: Future = Future()
    _requests.put((fn, future))
    return future.result()


def spawn(cmd: Sequence[str], log_path: str | Path | None = None, env: dict[str, str] | None = None,
          cwd: str | Path | None = None, die_with_parent: bool = True, append: bool = False) -> subprocess.Popen:
    """Start `cmd` in a new session, stdout and stderr into `log_path` (discarded when None)."""
    out = open(log_path, "ab" if append else "wb") if log_path is not None else subprocess.DEVNULL
    tie = die_with_parent and _PRCTL is not None

    def popen() -> subprocess.Popen:
        return subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, cwd=cwd, start_new_session=True,
                                preexec_fn=_die_with_parent if tie else None)

    try:
        return _on_lasting_thread(popen) if tie else popen()
    finally:
        if log_path is not None:
            out.close()


def terminate(popen: subprocess.Popen | None) -> None:
    """SIGTERM, if it still runs (does not wait: `reap` does, so many can stop at once)."""
    if popen is not None and popen.poll() is None:
        try:
            popen.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass


def reap(popen: subprocess.Popen | None, grace_s: float = 10.0) -> None:
    """Wait up to `grace_s` for it to exit, then SIGKILL it."""
    if popen is None:
        return
    try:
        popen.wait(grace_s)
    except subprocess.TimeoutExpired:
        log.warning("process %d ignored SIGTERM for %.0f s; killing it", popen.pid, grace_s)
        popen.kill()
        popen.wait()


def stop(popen: subprocess.Popen | None, grace_s: float = 10.0) -> None:
    terminate(popen)
    reap(popen, grace_s)


def follow(popen: subprocess.Popen, log_path: str | Path, poll_s: float = 0.5) -> int:
    """Copy what `popen` writes to its log onto this process's stderr until it exits; its status."""
    offset = 0
    while True:
        done = popen.poll() is not None
        with open(log_path, "rb") as f:
            f.seek(offset)
            data = f.read()
        offset += len(data)
        if data:
            sys.stderr.write(data.decode(errors="replace"))
            sys.stderr.flush()
        if done:
            return popen.returncode
        time.sleep(poll_s)
