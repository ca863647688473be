"""Test helpers (a test double's home is tests/, not the installed package): a real etcd on free loopback ports, and kvpool service processes.

    with EtcdServer(tmp_path) as etcd:          # /usr/bin/etcd (or $KVPOOL_ETCD)
        master = spawn(["master", "--port", "0", "--meta", etcd.meta])
        ...
        master.kill()                          # SIGKILL; .stop() is SIGTERM + wait
        assert wait_for(lambda: ..., timeout=10)   # poll a condition (every 0.05 s by default)

Every process started here is killed by `stop()` / the context manager, and `spawn` waits for the
service's "ready" line, so a test never races a half-started service.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence

import httpx

from kvpool.tools.launch.processes import clean_env, free_port
from kvpool.tools.chaos.procs import etcd_binary


def wait_for(pred: Callable[[], object], timeout: float = 10.0, step: float = 0.05,
             retry_on: tuple[type[BaseException], ...] = ()) -> bool:
    """Poll `pred()` every `step` seconds until it is true (True) or `timeout` seconds pass (False);
    an exception in `retry_on` (e.g. a cluster still electing its leader) counts as not yet."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if pred():
                return True
        except retry_on:
            pass
        time.sleep(step)
    return False


class EtcdServer:
    """A single-member etcd on 127.0.0.1 with its data in `workdir`."""

    def __init__(self, workdir: str | os.PathLike, binary: str | None = None):
        self.workdir = Path(workdir)
        self.binary = binary or etcd_binary()
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def meta(self) -> str:
        return f"etcd://127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def start(self, timeout: float = 20.0) -> "EtcdServer":
        if not self.binary:
            raise RuntimeError("etcd is not installed (apt-get install etcd-server, or set KVPOOL_ETCD)")
        data = self.workdir / f"etcd-{self.client_port}"
        client, peer = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        self._log = open(self.workdir / f"etcd-{self.client_port}.log", "wb")
        self.proc = subprocess.Popen(
            [self.binary, "--name", "kvpool-test", "--data-dir", str(data), "--listen-client-urls", client,
             "--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"kvpool-test={peer}", "--heartbeat-interval", "50", "--election-timeout", "500",
             "--log-level", "warn"],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "ETCD_UNSUPPORTED_ARCH": "amd64"})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {self._log.name}")
            try:
                if httpx.get(f"{client}/health", timeout=0.5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"etcd did not become healthy within {timeout}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "_log", None):
            self._log.close()

    def __enter__(self) -> "EtcdServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ServiceProcess:
    """A `kvpool ...` subprocess; `address` is the last word of its ready line."""

    def __init__(self, proc: subprocess.Popen, ready_line: str):
        self.proc = proc
        self.ready_line = ready_line
        self.address = ready_line.split()[-1]
        self.name = ready_line.split()[2] if ready_line.startswith("kvpool node") else self.address
        self.output: list[str] = []
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        for line in self.proc.stdout:  # keep the pipe from filling; tests may print it on failure
            self.output.append(line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL: no clean-up, like a crashed machine."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()


def spawn(args: Sequence[str], *, env: dict[str, str] | None = None, timeout: float = 30.0,
          log_level: str = "WARNING") -> ServiceProcess:
    """Start `kvpool <args>` and wait for its ready line ("kvpool ... at|serving at HOST:PORT")."""
    cmd = [sys.executable, "-c", "from kvpool.cli import main; main()", "--log-level", log_level, *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            env={**os.environ, **(env or {})})
    deadline = time.monotonic() + timeout
    lines: list[str] = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("kvpool "):
            return ServiceProcess(proc, line.strip())
    proc.kill()
    proc.wait()
    raise RuntimeError(f"kvpool {' '.join(args)} did not start:\n{''.join(lines)}")


@contextmanager
def serve_process(log: str | os.PathLike, dram_capacity: str,
                  env: dict[str, str] | None = None) -> Iterator[tuple[str, str]]:
    """`kvpool serve` in its own process with its admin API on a free port; yields (pool address,
    admin url) once it is serving and terminates it on exit. Its environment is this one without
    any KVPOOL_* variable, plus `env`; its stderr goes to the file `log`."""
    log = Path(log)
    admin_port = free_port()
    env = clean_env(**(env or {}))
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("kvpool")), "--log-level", "WARNING", "serve", "--port", "0",
         "--admin-port", str(admin_port), "--dram-capacity", dram_capacity],
        stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, env=env)
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("kvpool serving at "), (line, log.read_text()[-2000:])
        yield line.rsplit(" ", 1)[1], f"http://127.0.0.1:{admin_port}"
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
