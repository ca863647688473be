"""The peers `kvpool bench pool` measures against, each a real server on loopback:
Redis (redis-py over TCP) and, where the optional `mooncake` extra is installed, Mooncake Store
in TCP mode.

Every peer exposes the same small surface as our side of the bench:
`put(key, view)`, `get_into(key, out) -> int`, `get_batch_into(keys, outs)`, `remove(keys)`,
`close()`. Servers are started on free loopback ports and stopped by `close()`.

Mooncake topology (so bytes really cross TCP): its master (`mooncake_master`, with its built-in
HTTP metadata server) runs as one process; an "owner" process contributes the memory segment;
the bench process is a client with no segment of its own, so every get is a remote TCP read.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from kvpool.tools.launch.processes import free_port, stop

log = logging.getLogger(__name__)


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 15.0, what: str = "server") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout}s")


class RedisPeer:
    """A private redis-server (no persistence) and a redis-py client of it, over loopback TCP
    or (`unix=True`, named "redis_unix") over its unix socket: the same-host baseline."""

    name = "redis"

    def __init__(self, maxmemory: str = "2gb", unix: bool = False):
        import redis

        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        if not Path(binary).exists():
            raise RuntimeError("redis-server is not installed (Debian: apt-get install redis-server)")
        self._dir = tempfile.mkdtemp(prefix="kvpool-bench-redis-")
        self.port = free_port()
        sock = os.path.join(self._dir, "redis.sock")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self._dir, "--maxmemory", maxmemory, "--protected-mode", "yes", "--loglevel", "warning",
             "--unixsocket", sock, "--unixsocketperm", "700"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_port(self.port, self.proc, what="redis-server")
            if unix:
                self.name = "redis_unix"
                self.client = redis.Redis(unix_socket_path=sock, socket_timeout=30)
            else:
                self.client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=30)
            self.client.ping()
        except BaseException:
            self.close()
            raise

    def put(self, key: str, value: Any) -> None:
        self.client.set(key, memoryview(value).cast("B"))

    def get_into(self, key: str, out: Any) -> int:
        data = self.client.get(key)  # redis-py has no receive-into; the copy is part of its cost
        if data is None:
            raise KeyError(key)
        memoryview(out).cast("B")[:len(data)] = data
        return len(data)

    def get(self, key: str) -> bytes | None:
        return self.client.get(key)

    def get_batch_into(self, keys: Sequence[str], outs: Sequence[Any]) -> None:
        for data, out in zip(self.client.mget(keys), outs):
            memoryview(out).cast("B")[:len(data)] = data

    def remove(self, keys: Sequence[str]) -> None:
        if keys:
            self.client.delete(*keys)

    def close(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.close()
        stop(self.proc, 5.0)
        shutil.rmtree(self._dir, ignore_errors=True)


def mooncake_available() -> str | None:
    """None if Mooncake Store can run here, else why not (for the bench's note)."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return f"Mooncake Store not importable ({exc}); install the optional extra: pip install 'kvpool[mooncake]'"
    return None


@contextlib.contextmanager
def _stderr_to(path: str):
    """Send this process's fd 2 to `path` for a while: Mooncake's C++ logging (glog, INFO level,
    several lines per connection) would bury the bench's table and progress bar."""
    sys.stderr.flush()
    saved = os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _mooncake_env() -> dict[str, str]:
    env = dict(os.environ)
    env["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"  # loopback-only host: its default picks a NIC address
    env.setdefault("GLOG_minloglevel", "2")  # its INFO logging goes to stderr on every connection
    return env


class MooncakePeer:
    """Mooncake Store over TCP: master + owner process + this process as a segment-less client."""

    name = "mooncake"

    def __init__(self, segment_bytes: int, buffer_bytes: int):
        # its client library lives in this process: same loopback binding as the child processes
        os.environ.update({k: v for k, v in _mooncake_env().items() if k.startswith(("MC_", "GLOG_"))})
        import mooncake
        from mooncake.store import MooncakeDistributedStore

        binary = Path(mooncake.__file__).with_name("mooncake_master")
        self.rpc_port, self.meta_port = free_port(), free_port()
        self.master = self.owner = None
        self.store = None
        self._registered: list[Any] = []
        self.master = subprocess.Popen(
            [str(binary), f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
             "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={self.meta_port}", "--metrics_host=127.0.0.1",
             f"--metrics_port={free_port()}", "--eviction_high_watermark_ratio=0.95"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_mooncake_env())
        try:
            wait_port(self.rpc_port, self.master, what="mooncake_master")
            wait_port(self.meta_port, self.master, what="mooncake metadata server")
            self.owner = subprocess.Popen(
                [sys.executable, "-m", "kvpool.tools.bench.pool_peers", "mooncake-owner", self.metadata_url,
                 self.master_address, str(segment_bytes)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=_mooncake_env(),
                text=True)
            line = self.owner.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"the Mooncake segment owner did not start (said {line!r})")
            self.store = MooncakeDistributedStore()
            self.log_path = os.path.join(tempfile.gettempdir(), f"kvpool-bench-mooncake-{os.getpid()}.log")
            with _stderr_to(self.log_path):
                rc = self.store.setup("127.0.0.1", self.metadata_url, 0, buffer_bytes, "tcp", "", self.master_address)
            if rc != 0:
                raise RuntimeError(f"Mooncake client setup failed with code {rc}")
        except BaseException:
            self.close()
            raise

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.meta_port}/metadata"

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    def register(self, array: Any) -> None:
        """Register a numpy buffer for zero-copy put_from / get_into (Mooncake requires it)."""
        rc = self.store.register_buffer(array.ctypes.data, array.nbytes)
        if rc != 0:
            raise RuntimeError(f"Mooncake register_buffer failed with code {rc}")
        self._registered.append(array)

    def put(self, key: str, array: Any) -> None:
        rc = self.store.put_from(key, array.ctypes.data, array.nbytes)
        if rc != 0:
            raise RuntimeError(f"Mooncake put_from({key!r}) failed with code {rc}")

    def get_into(self, key: str, array: Any) -> int:
        n = self.store.get_into(key, array.ctypes.data, array.nbytes)
        if n < 0:
            raise RuntimeError(f"Mooncake get_into({key!r}) failed with code {n}")
        return n

    def get_batch_into(self, keys: Sequence[str], arrays: Sequence[Any]) -> None:
        results = self.store.batch_get_into(list(keys), [a.ctypes.data for a in arrays], [a.nbytes for a in arrays])
        bad = [r for r in results if r < 0]
        if bad:
            raise RuntimeError(f"Mooncake batch_get_into failed for {len(bad)} key(s), first code {bad[0]}")

    def remove(self, keys: Sequence[str]) -> None:
        for key in keys:
            self.store.remove(key, True)  # force: skip its lease check, these keys are ours

    def close(self) -> None:
        if self.store is not None:
            try:
                with _stderr_to(self.log_path):
                    self.store.close()
            except Exception:
                log.debug("closing the Mooncake client failed", exc_info=True)
            self.store = None
        if self.owner is not None and self.owner.poll() is None:
            try:
                self.owner.stdin.close()  # the owner exits when its stdin closes
                self.owner.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                stop(self.owner, 5.0)
        stop(self.master, 5.0)


def _mooncake_owner(metadata_url: str, master_address: str, segment_bytes: int) -> None:
    """The process that contributes Mooncake's memory segment; lives until stdin closes."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", metadata_url, segment_bytes, 16 << 20, "tcp", "", master_address)
    print("ready" if rc == 0 else f"setup failed {rc}", flush=True)
    sys.stdin.read()
    store.close()


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "mooncake-owner":
    _mooncake_owner(sys.argv[2], sys.argv[3], int(sys.argv[4]))
