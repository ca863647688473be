"""`ReadWorkers`: several processes serve a node's TCP gets of DRAM-resident objects (issue 29).

A node is one Python process: one GIL, one serve loop, at most one core however many clients
ask. With `[node] read_workers` = N - 1 > 0 the node opens a read port (`[node] read_port`,
advertised as `NodeInfo.read_address` and in `NodeStats`), serves it itself with its ordinary
`NodeGet` handler, and starts N - 1 worker processes (`kvpool.node.read_worker`) that serve it
too, bound with SO_REUSEPORT: the kernel spreads new connections over the N processes. The
workers start with the port's first get (until then no client reads over TCP, and a node whose
readers are all on its host, as in most tests, never pays for them; the connections made in the
second or so they take to start stay with the node, which serves them as before). A worker
maps the arena and the shm DRAM index read-only, as a same-host client does; a key it cannot
prove is the key's own (not in the index, on SSD, changed during its copy) it asks of the node
over the node's unix socket, so the node stays the authority. On this port a miss is `ABSENT`
(the node's own share answers so too), and -1 means "not here" (a worker could not ask the
node): a client takes that to the node's RPC (`RpcPath`). Puts and every other message stay on
the node's RPC port.

Measured (kvpool bench pool --workload many-clients, 64 KiB gets over TCP,
2 shared cores, one worker; BENCHMARKS.md): in the 2026-12-05 22:58 run 1.31x the node alone at
16 clients, 1.26x at 64, 1.05x at 4, 0.95x at one (three earlier, busier runs: 4 clients
1.12-1.41x, 16 and 64 0.93-1.47x, one 0.90-0.99x). On 2 cores the clients take the rest of the
machine, so the aggregate still falls past 4 clients; the workers are for the cores a node has.
What it costs: a get the index cannot serve (absent, on SSD) takes a hop from a worker to the
node on the host: a 64 KiB miss over loopback took 26-29 us against 20-22 us with the node alone
(before the hop, when the client asked the node itself: 89-121 us); hits 50-52 vs 45-47 us
(2026-12-06, one client, quiet machine). `read_workers = 0` suits a pool that mostly misses or reads SSD.

Invariants:
- Every connection on the read port, the node's or a worker's, passes the node's keyring
  handshake and `authz` (tenant keys scoped) under the node's `[rpc]` limits; the keyring goes to
  a worker on its stdin, never in argv or the environment.
- No orphans: each worker's stdin is a pipe whose write end only the node holds, so the node's
  end, however it ends, is the worker's end of file, and it exits (`read_worker.main`); `stop`
  also terminates them (SIGTERM, then SIGKILL) and waits for them.
- A worker that dies is logged and started again after `RESTART_S`; meanwhile its clients' reads
  fail over to the node (`Unavailable` on the read port: the node's RPC serves that get) and
  their next connection lands on a live process.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading
from typing import Any

from kvpool.messages import ABSENT, NodeData, NodeGet
from kvpool.rpc import RpcServer

log = logging.getLogger("kvpool.node")

RESTART_S = 1.0  # a dead worker is started again after this long (doubled per failed start, up to a minute)
READY_S = 60.0  # how long a starting worker may take to serve its port
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds `kvpool`


def worker_count(setting: int) -> int:
    """`[node] read_workers`: -1 means min(CPUs, 4) - 1 (the node itself is the N-th reader)."""
    return max(0, min(os.cpu_count() or 1, 4) - 1) if setting < 0 else setting


class ReadWorkers:
    """The read port of `node` (a `StoreNode` being started) and `count` worker processes reading
    its arena and its shm DRAM index at `index_path`."""

    def __init__(self, node: Any, count: int, index_path: str):
        self.node = node
        self.count = count
        self.index_path = index_path
        self.server: RpcServer | None = None
        self.procs: list[subprocess.Popen | None] = [None] * count
        self._ready: set[int] = set()  # pids of the workers that served their port
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._wanted = threading.Event()  # set by the read port's first get (or `wait_ready`)
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        return self.server.address

    def start(self) -> "ReadWorkers":
        node, s = self.node, self.node.settings
        handler, wanted = node.handlers()[NodeGet], self._wanted

        def get(msg: NodeGet, payload: Any, conn: Any) -> Any:
            if not wanted.is_set():
                wanted.set()
            reply = handler(msg, payload, conn)  # (NodeData, views, release)
            data = reply[0]
            if -1 in data.sizes:  # the node is the authority: on this port, a miss says so
                reply = (NodeData([ABSENT if n == -1 else n for n in data.sizes], data.ssd), *reply[1:])
            return reply

        # The node's own share of the port: its ordinary get handler, with its keyring.
        self.server = RpcServer({NodeGet: get}, s.pool.host, s.node.read_port,
                                name="node-read", on_close=node.conn_closed, unix=False, settings=s,
                                keyring=node.rpc.keyring, inline={NodeGet: node.inline()[NodeGet]},
                                reuse_port=True).start()
        # Workers are forked by this thread, which lives until `stop`: nothing ties them to the
        # thread that called `start`.
        self._thread = threading.Thread(target=self._supervise, name="node-readers", daemon=True)
        self._thread.start()
        log.info("node %s: read port %s, %d read worker(s)", node.node_id, self.address, self.count)
        return self

    def wait_ready(self, timeout: float = READY_S) -> bool:
        """Start the workers if no get did yet; whether all `count` are up and serving the port
        within `timeout` (for tests and tools)."""
        self._wanted.set()
        with self._changed:
            return self._changed.wait_for(lambda: len(set(self.pids()) & self._ready) == self.count, timeout)

    def stop(self) -> None:
        self._stop.set()
        self._wanted.set()  # the supervisor, if still waiting for a first get, ends
        with self._changed:
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.server is not None:
            self.server.stop()

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p is not None and p.poll() is None]

    def spec(self) -> dict[str, Any]:
        """What a worker is told on its stdin (`kvpool.node.read_worker`)."""
        node = self.node
        keyring = node.rpc.keyring
        settings = node.settings.model_dump(mode="json")
        if keyring is None:  # authentication is off here: so it is in the worker
            settings["security"].update(auth_file=None, local_auth=False)
        return {"settings": settings, "keyring": keyring.to_toml() if keyring is not None else None,
                "keyring_source": getattr(keyring, "source", ""), "keyring_local": getattr(keyring, "local", False),
                "arena": node.store.arena.path, "arena_size": node.store.arena.size, "index": self.index_path,
                "host": node.settings.pool.host, "port": self.server.port, "node": node.rpc.address,
                "node_unix": node.rpc.unix_address, "node_id": node.node_id}

    # -- the supervisor thread -------------------------------------------------------------------
    def _supervise(self) -> None:
        spec = (json.dumps(self.spec()) + "\n").encode()
        failed = 0  # starts in a row that never served the port: a worker that cannot start is not spun on
        self._wanted.wait()
        try:
            while not self._stop.is_set():
                for i, proc in enumerate(self.procs):
                    if proc is not None and proc.poll() is None:
                        continue
                    if proc is not None:
                        log.warning("node %s: read worker %d exited with %s; starting another", self.node.node_id,
                                    proc.pid, proc.returncode)
                        self._close(proc)
                    self.procs[i] = proc = self._spawn(spec)
                    if proc is None or not self._started(proc):
                        failed += 1
                        break
                    failed = 0
                    with self._changed:
                        self._ready.add(proc.pid)
                        self._changed.notify_all()
                self._stop.wait(min(60.0, RESTART_S * 2 ** failed))
        finally:
            procs = [p for p in self.procs if p is not None]
            for proc in procs:  # their end of file first: they all stop at once
                self._close(proc)
            for proc in procs:
                self._end(proc)

    def _spawn(self, spec: bytes) -> subprocess.Popen | None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH", "")) if p)  # our own code
        env.pop("KVPOOL_AUTH_FILE", None)  # the keyring comes on stdin, as the node has it
        try:
            proc = subprocess.Popen([sys.executable, "-m", "kvpool.node.read_worker"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, env=env, close_fds=True)
            proc.stdin.write(spec)
            proc.stdin.flush()
        except OSError as exc:
            log.warning("node %s: cannot start a read worker: %s", self.node.node_id, exc)
            return None
        return proc

    def _started(self, proc: subprocess.Popen) -> bool:
        """Wait for the worker's "ready" (or its end, or `stop`)."""
        fd = proc.stdout.fileno()
        waited = 0.0
        while waited < READY_S and not self._stop.is_set():
            if select.select([fd], [], [], 0.2)[0]:
                return proc.stdout.readline().strip() == b"ready"
            waited += 0.2
        return False

    @staticmethod
    def _close(proc: subprocess.Popen) -> None:
        for pipe in (proc.stdin, proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass

    @staticmethod
    def _end(proc: subprocess.Popen) -> None:
        """Wait for a worker whose stdin is closed to stop; make it if it does not."""
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
