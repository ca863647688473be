"""The callgrind side of `instr_per_op.py`: the 5-line C library that issues callgrind's client
requests, the `--serve` wrapper around `kvpool serve` (SIGUSR1 starts a window, SIGUSR2 dumps it
under the client's label, each acknowledged through a file), which of its threads are counted, and
the client's handle on those requests (`Server`). How and why: `instr_per_op.py`'s docstring."""

from __future__ import annotations

import ctypes
import gc
import json
import os
import re
import signal
import subprocess
import sys
import time

# the server's threads that are not counted: they wake on a clock (or serve no connection's
# requests), so what they execute in a window depends on how long it lasts, not on its ops
UNCOUNTED = re.compile(r"MainThread|master-tick|node-heartbeat|kvpool-populate|.*-accept|metrics-http|admin-http-.*"
                       r"|etcd-.*")
LIB_C = r"""
#include <valgrind/valgrind.h>
#include <valgrind/callgrind.h>
int kv_running(void) { return RUNNING_ON_VALGRIND; }
void kv_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
void kv_dump(const char *label) { CALLGRIND_DUMP_STATS_AT(label); }
"""

def _compile_lib(folder: str) -> str:
    src, lib = os.path.join(folder, "cgreq.c"), os.path.join(folder, "cgreq.so")
    with open(src, "w") as f:
        f.write(LIB_C)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", lib, src], check=True)
    return lib


def _ack(folder: str) -> int:
    try:
        with open(os.path.join(folder, "ack")) as f:
            return int(f.read() or 0)
    except (OSError, ValueError):
        return 0


def _keyring_in_use() -> str:
    """The keyring this process's servers and clients take, as its tree resolves it: "configured"
    (KVPOOL_AUTH_FILE), "per-user" (this user's own, made by default: kvpool.security.local) or
    "none". An auth-off run must say "none" on both sides."""
    from kvpool.security.keyring import load_keyring

    if load_keyring(None) is not None:
        return "configured"
    try:
        from kvpool.security.local import local_keyring
    except ImportError:  # a tree from before the per-user keyring
        return "none"
    return "per-user" if local_keyring() is not None else "none"


def _serve(folder: str, lib_path: str, serve_args: list[str]) -> None:
    """`--serve`: `kvpool serve` whose callgrind counts the client zeroes (SIGUSR1) and dumps
    (SIGUSR2, under the label in `folder`/label); each request is acknowledged in `folder`/ack."""
    lib = ctypes.CDLL(lib_path)
    seq = [_ack(folder)]

    def ack() -> None:
        seq[0] += 1
        tmp = os.path.join(folder, f"ack.{os.getpid()}")
        with open(tmp, "w") as f:
            f.write(str(seq[0]))
        os.replace(tmp, os.path.join(folder, "ack"))

    def zero(*_: object) -> None:
        # a dump, not CALLGRIND_ZERO_STATS: that zeroes only the calling thread's counts (this
        # one's, which count nothing), while a dump resets every thread's
        lib.kv_dump(b"discard")
        ack()

    def dump(*_: object) -> None:
        with open(os.path.join(folder, "label")) as f:
            label = f.read().strip()
        lib.kv_dump(label.encode())
        import threading

        with open(os.path.join(folder, "threads.json"), "w") as f:  # which threads counted
            json.dump({"alive": {t.name: not UNCOUNTED.fullmatch(t.name) for t in threading.enumerate()},
                       "started": STARTED, "gc": gc.get_stats()}, f)
        ack()

    with open(os.path.join(folder, "keyring"), "w") as f:
        f.write(_keyring_in_use())
    _count_threads(lib, lambda name: not UNCOUNTED.fullmatch(name))
    if os.environ.get("KVPOOL_INSTR_GC") == "off":
        gc.disable()
    signal.signal(signal.SIGUSR1, zero)
    signal.signal(signal.SIGUSR2, dump)
    import importlib

    sys.argv = ["kvpool", "--log-level", "WARNING", *serve_args]
    importlib.import_module("kvpool.cli").main()  # `kvpool serve` in this process, as its command line runs it


STARTED: dict[str, int] = {}  # thread name -> how many started (the server's, for threads.json)


def _count_threads(lib: ctypes.CDLL, counted) -> None:
    """Threads whose name `counted` accepts turn callgrind's collection on for themselves when
    they start, and off when they end (valgrind runs with --collect-atstart=no; the collect state
    is per thread, and a new thread that reuses an ended one's valgrind id inherits its state, so
    a thread must leave it off)."""
    import threading

    run = threading.Thread.run

    def collecting(self: threading.Thread) -> None:
        on = counted(self.name)
        STARTED[self.name] = STARTED.get(self.name, 0) + 1
        if on:
            lib.kv_toggle()
        try:
            run(self)
        finally:
            if on:
                lib.kv_toggle()

    threading.Thread.run = collecting


class Server:
    """The client's handle on the server's counts (a no-op without valgrind)."""

    def __init__(self, pid: int, folder: str, counting: bool):
        self.pid, self.folder, self.counting = pid, folder, counting

    def _request(self, sig: int, label: str = "") -> None:
        if not self.counting:
            return
        if label:
            with open(os.path.join(self.folder, "label"), "w") as f:
                f.write(label)
        before = _ack(self.folder)
        os.kill(self.pid, sig)
        deadline = time.monotonic() + 600
        while _ack(self.folder) <= before:
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not acknowledge a callgrind request")
            time.sleep(0.02)

    def zero(self) -> None:
        self._request(signal.SIGUSR1)

    def dump(self, label: str) -> None:
        self._request(signal.SIGUSR2, label)
