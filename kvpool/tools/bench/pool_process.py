"""Our side of `kvpool bench pool` (and `kvpool/tools/scripts/profile_single_key.py --pair`): a `kvpool
serve` in a child process, how much CPU it has used, when it is idle, and the same with a
keyring (a node and one tenant) for measuring authentication's cost."""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import time
from typing import Any, Callable, Sequence

from kvpool.tools.launch.processes import KVPOOL, clean_env, stop

log = logging.getLogger(__name__)


class PoolProcess:
    """`kvpool serve` on a free loopback port in a child process (or on `host`, run through
    `prefix`: inside a network namespace of `kvpool.tools.netns`)."""

    def __init__(self, dram_capacity: int, auth_file: str | None = None, settings: dict[str, str] | None = None,
                 host: str = "127.0.0.1", prefix: Sequence[str] = ()):
        """`settings`: KVPOOL_* variables for the pool (none of this process's are passed on)."""
        env = clean_env(**(settings or {}))
        if auth_file:
            env["KVPOOL_AUTH_FILE"] = auth_file
        self.proc = subprocess.Popen(
            [*prefix, *KVPOOL, "--log-level", "WARNING", "serve", "--host", host, "--port", "0", "--admin-port", "0",
             "--dram-capacity", str(dram_capacity)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        line = self.proc.stdout.readline().strip()
        if not line.startswith("kvpool serving at "):
            stop(self.proc, 5.0)
            raise RuntimeError(f"kvpool serve did not start (said {line!r})")
        self.address = line.rsplit(" ", 1)[1]
        self.cpu_seconds = cpu_clock(self.proc.pid)

    def settle(self, timeout: float = 120.0) -> None:
        """Wait until the pool is idle: a new pool maps its whole DRAM arena in a background thread
        (`kvpool.shm.arena.populate`, ~1 s of CPU per GiB here, holding the GIL in steps), and
        a pool measured while that runs is slower than an older one for reasons of its age."""
        deadline, quiet = time.monotonic() + timeout, 0
        last = self.cpu_seconds()
        while quiet < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
            now = self.cpu_seconds()
            quiet = quiet + 1 if now - last < 0.005 else 0  # under 5% of a core
            last = now

    def close(self) -> None:
        stop(self.proc, 10)


def close_all(closers: list[Callable[[], None]]) -> None:
    """Run a bench's clean-ups, last first; one that fails is logged, the others still run."""
    for close in reversed(closers):
        try:
            close()
        except Exception:
            log.warning("cleanup failed", exc_info=True)


def cpu_clock(pid: int) -> Callable[[], float]:
    """The CPU seconds (user + system, all threads) process `pid` has used so far: its POSIX CPU
    clock (ns resolution) where libc gives it, else /proc/<pid>/stat (clock ticks)."""
    import ctypes

    try:
        clock = ctypes.c_int()
        if ctypes.CDLL(None).clock_getcpuclockid(pid, ctypes.byref(clock)) == 0:
            clock_id = clock.value
            return lambda: time.clock_gettime(clock_id)
    except (OSError, AttributeError):
        pass
    tick = os.sysconf("SC_CLK_TCK")

    def from_proc() -> float:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick

    return from_proc


def auth_pool(dram_capacity: int, settings: dict[str, str] | None = None,
              principal: str = "bench", **where: Any) -> tuple[PoolProcess, Any, Callable[[], None]]:
    """A pool with a keyring of a node ("node") and one tenant ("bench"; a file 0600 in a private
    temp directory), the credential of `principal`, and how to stop it and delete the keyring.
    `where`: `host` and `prefix` of `PoolProcess`."""
    import shutil
    import tempfile

    from kvpool.security.keyring import Credential

    folder = tempfile.mkdtemp(prefix="kvpool-bench-auth-")
    path, tenant = write_bench_keyring(folder)
    try:
        server = PoolProcess(dram_capacity, auth_file=path, settings=settings, **where)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise

    def cleanup() -> None:
        server.close()
        shutil.rmtree(folder, ignore_errors=True)

    return server, Credential(principal, (node if principal == "node" else tenant).encode()), cleanup


def write_bench_keyring(folder: str) -> tuple[str, str]:
    """A keyring file (0600) in `folder` of a node and one tenant ("bench"): (its path, the tenant's secret)."""
    path = os.path.join(folder, "keyring.toml")
    node, tenant = secrets.token_hex(24), secrets.token_hex(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f'[principals.node]\nrole = "node"\nsecret = "{node}"\n'
                f'[principals.bench]\nrole = "tenant:bench"\nsecret = "{tenant}"\n')
    return path, tenant
