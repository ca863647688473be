"""The processes of a chaos cluster: one etcd, `kvpool master` and `kvpool node` services.

The same shape as the test suite's helpers (tests/kvpool/etcd_testing.py), which `kvpool chaos`
cannot import (tests/ is not installed); what chaos adds is restart on the same ports, data
directory and node id, so a restarted process is the same member coming back, and signals
(SIGKILL, SIGSTOP/SIGCONT) sent by the fault schedule.

In a namespace fabric (`kvpool.tools.netns`) a process runs inside its member's namespace
(`prefix`, `ip netns exec ...`) and listens on the member's address at a fixed port.

Invariant: every process started here is stopped by `stop()`; a paused process is resumed first.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Sequence

import httpx

from kvpool.tools.launch.processes import KVPOOL, clean_env, free_port, spawn, stop

log = logging.getLogger(__name__)


def etcd_binary() -> str | None:
    return os.environ.get("KVPOOL_ETCD") or shutil.which("etcd") or (
        "/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)


class Managed:
    """A restartable child process: `start()`, `kill()` (SIGKILL), `pause()`/`resume()`, `stop()`."""

    def __init__(self, name: str, workdir: Path, prefix: Sequence[str] = ()):
        self.name = name
        self.workdir = workdir
        self.prefix = list(prefix)  # runs the command elsewhere (a network namespace), or nothing
        self.proc: subprocess.Popen | None = None
        self.paused = False
        self.starts = 0

    def command(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        return dict(os.environ)

    def wait_ready(self, timeout: float) -> None:
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 60.0) -> "Managed":
        log_path = self.workdir / f"{self.name}.log"
        with open(log_path, "ab") as logfile:
            logfile.write(f"==== start {self.starts} at {time.time():.3f}\n".encode())
        self.proc = spawn([*self.prefix, *self.command()], log_path, env=self.env(), append=True)
        self.starts += 1
        self.paused = False
        self.wait_ready(timeout)
        return self

    def signal(self, sig: int) -> None:
        if self.alive:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL: no clean-up, like a crashed machine."""
        if self.alive:
            if self.paused:
                self.resume()
            self.proc.kill()
            self.proc.wait(timeout=10)

    def pause(self) -> None:
        self.signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        self.signal(signal.SIGCONT)
        self.paused = False

    def stop(self, timeout: float = 10.0) -> None:
        if self.alive:
            if self.paused:
                self.resume()
            stop(self.proc, timeout)


class Etcd(Managed):
    """A single-member etcd on fixed ports (loopback, or `host` in a namespace: etcd's own
    2379/2380 there); a restart keeps its data directory."""

    def __init__(self, workdir: Path, binary: str | None = None, host: str = "127.0.0.1",
                 prefix: Sequence[str] = ()):
        super().__init__("etcd", workdir, prefix)
        self.binary = binary or etcd_binary()
        if not self.binary:
            raise RuntimeError("etcd is not installed (apt-get install etcd-server, or set KVPOOL_ETCD)")
        self.host = host
        self.client_port, self.peer_port = (free_port(), free_port()) if not prefix else (2379, 2380)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.client_port}"

    def command(self) -> list[str]:
        client, peer = f"http://{self.address}", f"http://{self.host}:{self.peer_port}"
        return [self.binary, "--name", "chaos", "--data-dir", str(self.workdir / "etcd-data"),
                "--listen-client-urls", client, "--advertise-client-urls", client, "--listen-peer-urls", peer,
                "--initial-advertise-peer-urls", peer, "--initial-cluster", f"chaos={peer}",
                "--heartbeat-interval", "50", "--election-timeout", "500", "--log-level", "warn"]

    def env(self) -> dict[str, str]:
        return {**os.environ, "ETCD_UNSUPPORTED_ARCH": "amd64"}

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {self.workdir}/etcd.log")
            try:
                if httpx.get(f"http://{self.address}/health", timeout=0.5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"etcd did not become healthy within {timeout}s")


class Service(Managed):
    """`kvpool <args>` on a fixed port; ready when the port accepts connections.

    The port is fixed so that a restarted node or master comes back at the same address (as a
    machine with a static address would)."""

    def __init__(self, name: str, workdir: Path, args: Sequence[str], env: dict[str, str] | None = None,
                 host: str = "127.0.0.1", prefix: Sequence[str] = ()):
        super().__init__(name, workdir, prefix)
        self.host = host
        self.port = free_port() if not prefix else 7000  # a namespace of its own: any port is free
        self.args = list(args)
        self.extra_env = env or {}

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [*KVPOOL, "--log-level", "INFO", *self.args,
                "--host", self.host, "--port", str(self.port)]

    def env(self) -> dict[str, str]:
        return clean_env(**self.extra_env)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; "
                                   f"see {self.workdir}/{self.name}.log")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"{self.name} did not listen on {self.port} within {timeout}s")


def start_all(procs: Sequence[Managed], timeout: float = 90.0) -> None:
    """Start several processes at once (nodes wait for a leader by themselves)."""
    errors: list[BaseException] = []

    def one(p: Managed) -> None:
        try:
            p.start(timeout)
        except BaseException as exc:  # reported below, after every thread ends
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(p,)) for p in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
