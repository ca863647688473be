"""Start a local cluster as real processes: an embedded pool (`kvpool serve`) and reference
workers (`kvpool worker`), each on a free loopback port, and stop them again.

Used by `kvpool up`, the e2e tests and the adapter benchmark. Every process gets its own log
file under `workdir`; the pool reports its address on its first stdout line, a worker through
its ready file, so nothing races for a port.

Invariants:
- `start` returns only once every process answers (pool address known, worker `/health` 200),
  or raises `Unavailable` with the tail of the failing process's log, having stopped the rest.
- `stop` ends every process it started (SIGTERM, then SIGKILL after a grace period), workers
  before the pool, and is safe to call twice. Children also get SIGTERM if this process dies
  (Linux parent-death signal), so a killed launcher leaves no orphans. That signal is tied to the
  thread that started them: call `start` from a thread that outlives the cluster (the main one).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx

from kvpool.errors import Unavailable
from kvpool.tools.launch.processes import KVPOOL, reap, spawn, terminate
from kvpool.security.http_guard import internal_headers
from kvpool.config import read_env
from kvpool.security.keyring import load_keyring

log = logging.getLogger(__name__)

@dataclass
class WorkerSpec:
    role: str
    name: str = ""
    args: list[str] = field(default_factory=list)  # extra `kvpool worker` flags
    env: dict[str, str] = field(default_factory=dict)  # its own environment over the cluster's (a keyring)


@dataclass
class PoolSpec:
    args: list[str] = field(default_factory=list)  # extra `kvpool serve` flags
    address: str | None = None  # use a pool that is already running instead of starting one


@dataclass
class RouterSpec:
    port: int = 0
    args: list[str] = field(default_factory=list)  # extra `kvpool router` flags
    env: dict[str, str] = field(default_factory=dict)  # its own environment over the cluster's


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path
    url: str = ""

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class LocalCluster:
    def __init__(self, workdir: str | os.PathLike, workers: list[WorkerSpec], pool: PoolSpec | None = None,
                 env: dict[str, str] | None = None, timeout_s: float = 600.0, router: RouterSpec | None = None):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.pool_spec = pool or PoolSpec()
        self.specs = workers
        for i, spec in enumerate(self.specs):
            spec.name = spec.name or f"{spec.role}-{i}"
        self.env = {**os.environ, **(env or {})}
        self.timeout_s = timeout_s
        self.pool_address = self.pool_spec.address or ""
        self.pool_proc: Proc | None = None
        self.workers: dict[str, Proc] = {}
        self.router_spec = router
        self.router_proc: Proc | None = None

    @property
    def router_url(self) -> str:
        return self.router_proc.url if self.router_proc is not None else ""

    # -- public --------------------------------------------------------------------------------
    def url(self, name_or_role: str) -> str:
        if name_or_role in self.workers:
            return self.workers[name_or_role].url
        for proc in self.workers.values():
            if proc.name.startswith(name_or_role + "-"):
                return proc.url
        raise KeyError(name_or_role)

    def start(self, progress: Callable[[str], None] | None = None, sequential: bool | None = None) -> "LocalCluster":
        say = progress or (lambda msg: log.info("%s", msg))
        try:
            if not self.pool_address:
                say("starting the pool")
                self.pool_proc = self._spawn("pool", ["serve", "--host", "127.0.0.1", "--port", "0",
                                                      "--admin-port", "0", *self.pool_spec.args])
                self.pool_address = self._wait_pool(self.pool_proc)
                say(f"pool serving at {self.pool_address}")
            if self.router_spec is not None:
                self.router_proc = self._start_router(self.router_spec)
                say(f"router serving at {self.router_proc.url}")
            if sequential is None:
                sequential = not model_is_cached()
            pending = []
            for spec in self.specs:
                proc = self._spawn_worker(spec)
                if sequential:  # the first load converts the model; let one process do it
                    say(f"starting {spec.name} (first start converts the model, ~40 s)")
                    self._wait_worker(proc, say)
                else:
                    pending.append(proc)
            for proc in pending:
                say(f"waiting for {proc.name}")
                self._wait_worker(proc, say)
            if self.router_proc is not None:
                self._wait_registered(say)
        except BaseException:
            self.stop()
            raise
        return self

    def add_worker(self, spec: WorkerSpec) -> Proc:
        """Start one more worker on the running cluster (it joins the router by itself)."""
        spec.name = spec.name or f"{spec.role}-{len(self.workers) + len(self.specs)}"
        self.specs.append(spec)
        proc = self._spawn_worker(spec)
        self._wait_worker(proc, lambda msg: log.info("%s", msg))
        return proc

    def stop(self, grace_s: float = 10.0) -> None:
        procs = list(self.workers.values())
        for proc in procs:
            terminate(proc.popen)
        for proc in procs:
            reap(proc.popen, grace_s)
        self.workers.clear()
        if self.router_proc is not None:
            terminate(self.router_proc.popen)
            reap(self.router_proc.popen, grace_s)
            self.router_proc = None
        if self.pool_proc is not None:
            terminate(self.pool_proc.popen)
            reap(self.pool_proc.popen, grace_s)
            self.pool_proc = None

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- internals -----------------------------------------------------------------------------
    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Proc:
        log_path = self.workdir / f"{name}.log"
        return Proc(name, spawn([*KVPOOL, *args], log_path, env={**self.env, **(env or {})}, cwd=self.workdir),
                    log_path)

    def _spawn_worker(self, spec: WorkerSpec) -> Proc:
        ready = self.workdir / f"{spec.name}.ready"
        ready.unlink(missing_ok=True)
        router = ["--router", self.router_url] if self.router_proc is not None else []
        proc = self._spawn(spec.name, ["worker", "--role", spec.role, "--host", "127.0.0.1", "--port", "0",
                                       "--pool", self.pool_address, "--ready-file", str(ready), *router,
                                       *spec.args], spec.env)
        self.workers[spec.name] = proc
        return proc

    def _start_router(self, spec: RouterSpec) -> Proc:
        ready = self.workdir / "router.ready"
        ready.unlink(missing_ok=True)
        proc = self._spawn("router", ["router", "--host", "127.0.0.1", "--port", str(spec.port),
                                      "--pool", self.pool_address, "--ready-file", str(ready), *spec.args],
                           spec.env)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if ready.exists():
                proc.url = json.loads(ready.read_text())["url"]
                return proc
            self._check_alive(proc)
            time.sleep(0.05)
        raise Unavailable(f"the router did not start within 60 s:\n{proc.log_tail()}")

    def _wait_registered(self, say: Callable[[str], None]) -> None:
        """Every worker we started is in the router's rotation."""
        want = {proc.url for proc in self.workers.values()}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                listed = httpx.get(f"{self.router_url}/admin/workers", timeout=5,
                                   headers=internal_headers(load_keyring(self.auth_file()))).json()["workers"]
                if want <= {w["url"] for w in listed if w["status"] == "up"}:
                    say(f"router has {len(want)} workers")
                    return
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            self._check_alive(self.router_proc)
            time.sleep(0.1)
        raise Unavailable(f"workers did not join the router within 60 s:\n{self.router_proc.log_tail()}")

    def _wait_pool(self, proc: Proc) -> str:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            for line in proc.log_tail(200).splitlines():
                if line.startswith("kvpool serving at "):
                    return line.split()[-1]
            self._check_alive(proc)
            time.sleep(0.05)
        raise Unavailable(f"the pool did not start within {self.timeout_s:.0f} s:\n{proc.log_tail()}")

    def _wait_worker(self, proc: Proc, say: Callable[[str], None]) -> None:
        ready = self.workdir / f"{proc.name}.ready"
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if ready.exists():
                proc.url = json.loads(ready.read_text())["url"]
                try:
                    if httpx.get(f"{proc.url}/health", timeout=5).status_code == 200:
                        say(f"{proc.name} ready at {proc.url}")
                        return
                except httpx.HTTPError:
                    pass
            self._check_alive(proc)
            time.sleep(0.1)
        raise Unavailable(f"{proc.name} did not become healthy within {self.timeout_s:.0f} s:\n{proc.log_tail()}")

    def auth_file(self) -> str | None:
        """The keyring the cluster's processes get (their environment's), if any."""
        return read_env(self.env)[0].get("security", {}).get("auth_file")

    @staticmethod
    def _check_alive(proc: Proc) -> None:
        code = proc.popen.poll()
        if code is not None:
            raise Unavailable(f"{proc.name} exited with status {code}:\n{proc.log_tail()}")


def model_is_cached(model_cache: str | None = None) -> bool:
    """True when the reference model was converted already (workers then start in seconds)."""
    from reference_worker.model import is_cached

    return is_cached(model_cache)
