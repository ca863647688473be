"""A node's read workers (`kvpool.node.readers`, issue 29): processes beside the node that serve TCP
gets of DRAM objects from its shm arena and index on a shared read port.

Real processes on loopback: an embedded pool in this process whose workers are child processes,
and a `kvpool serve` child for what killing a node does. A connection's server is told apart by
`NodeStats` (a worker answers with its pid; the node's own share of the port serves gets only)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time

import numpy as np
import pytest

import kvpool
from kvpool.config import load_settings
from kvpool.embedded import EmbeddedPool
from kvpool.errors import KVPoolError, Unauthorized
from kvpool.messages import ABSENT, NodeGet, NodeStats
from kvpool.rpc import RpcClient
from kvpool.rpc.frame import parse_address, send_frame
from kvpool.security.keyring import Credential, Keyring
from kvpool.shm.index import ShmIndexReader, supported
from kvpool.tools.launch.processes import KVPOOL, child_pids, clean_env, stop

pytestmark = pytest.mark.skipif(not supported(), reason="read workers read the shm index (x86-64 only)")


def start_pool(workers: int, dram: str = "64MiB", **settings) -> EmbeddedPool:
    pool = EmbeddedPool(load_settings(port=0, admin_port=0, dram_capacity=dram, heartbeat_s=0.2,
                                      read_workers=workers, **settings)).start()
    if workers:
        assert pool.node.readers.wait_ready(60)
    return pool


@pytest.fixture
def pool():
    p = start_pool(2)
    yield p
    p.stop()


def worker_conn(address: str, credential=None) -> tuple[RpcClient, int]:
    """A connection to the read port that a worker (not the node) serves, and that worker's pid."""
    for _ in range(64):
        rpc = RpcClient(address, credential=credential)
        try:
            pid = rpc.call(NodeStats()).doc["read_worker"]
            return rpc, pid
        except KVPoolError:  # the node's share of the port: it serves gets only
            rpc.close()
    raise AssertionError("64 connections and none landed on a worker")


def get(rpc: RpcClient, key: str) -> bytes | None:
    data = rpc.call(NodeGet([key]))
    return rpc.read_payload(data.sizes[0]) if data.sizes[0] >= 0 else None


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_gets_through_the_read_port_return_the_right_bytes(pool):
    values = {f"k{i}": os.urandom(n) for i, n in enumerate((1, 4096, 65536, 1 << 20, 3 << 20))}
    with kvpool.connect(pool.address, use_shm=False) as client:
        for key, value in values.items():
            client.put(key, value)
        conn = client._nodes[pool.address]
        assert conn.read_address == pool.node.readers.address != pool.address
        for key, value in values.items():
            assert client.get(key) == value
            buf = np.zeros(len(value) + 7, dtype=np.uint8)
            assert client.get_into(key, buf) == len(value) and buf[:len(value)].tobytes() == value
        assert client.get_batch([*values, "absent"]) == [*values.values(), None]
        assert conn.reader is not None and conn.reader.connected  # the gets went to the read port
        assert client.get("absent") is None  # the read port says the node has none
    rpc, pid = worker_conn(pool.node.readers.address)
    assert pid in pool.node.readers.pids()
    for key, value in values.items():
        assert get(rpc, key) == value
    data = rpc.call(NodeGet([*values, "absent"]))
    assert data.sizes == [len(v) for v in values.values()] + [ABSENT]  # the worker asked the node
    assert rpc.read_payload(sum(map(len, values.values()))) == b"".join(values.values())
    rpc.close()


def node_conn(address: str) -> RpcClient:
    """A connection to the read port that the node's own share serves (it refuses `NodeStats`,
    and the connection stays usable)."""
    for _ in range(64):
        rpc = RpcClient(address)
        try:
            rpc.call(NodeStats())
        except KVPoolError:  # only a worker answers NodeStats here
            return rpc
        rpc.close()
    raise AssertionError("64 connections and none landed on the node")


def test_what_the_index_cannot_serve_is_answered_in_one_trip(tmp_path):
    """A worker asks the node for what its index lacks (absent, on SSD): a miss is `ABSENT` (the
    client asks nobody else) and an SSD object's bytes come back, from the worker and from the
    node's own share of the port alike; the client's gets agree, hits and misses."""
    pool = start_pool(2, dram="8MiB", ssd_path=str(tmp_path / "ssd"), ssd_capacity="64MiB")
    try:
        values = {f"v{i}": os.urandom(1 << 20) for i in range(24)}  # 24 MiB through 8 MiB of DRAM
        with kvpool.connect(pool.address, use_shm=False) as client:
            for key, value in values.items():
                client.put(key, value)
            address = pool.node.readers.address
            index = ShmIndexReader(pool.node.store.dram.index.path)
            on_ssd = [k for k in values if index.find(k) is None]
            assert len(on_ssd) >= 2, "objects did not leave DRAM"
            rpc, _ = worker_conn(address)
            mine = node_conn(address)
            for conn, key in ((rpc, on_ssd[0]), (mine, on_ssd[1])):  # a read promotes: one key each
                data = conn.call(NodeGet(["absent", key, "v23"]))
                assert data.sizes[0] == ABSENT and data.sizes[1:] == [1 << 20, 1 << 20]
                assert conn.read_payload(1 << 20) == values[key]
                assert conn.read_payload(1 << 20) == values["v23"]
                assert 1 in data.ssd  # the SSD read says so, for the client's hit tiers
            rpc.close()
            mine.close()
            for key, value in values.items():
                assert client.get(key) == value
            assert client.get("absent") is None
            assert [v == values[k] for k, v in zip(values, client.get_batch(list(values)))] == [True] * 24
    finally:
        pool.stop()


def test_a_workers_reads_count_as_hits_at_the_node(pool):
    with kvpool.connect(pool.address, use_shm=False) as client:
        client.put("hot", b"h" * 10_000)
    before = pool.node.store.stats()["tiers"]["dram"]["hits"]
    rpc, _ = worker_conn(pool.node.readers.address)
    for _ in range(5):
        assert get(rpc, "hot") == b"h" * 10_000
    rpc.close()
    deadline = time.monotonic() + 10
    while pool.node.store.stats()["tiers"]["dram"]["hits"] < before + 5 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pool.node.store.stats()["tiers"]["dram"]["hits"] >= before + 5


def _value(i: int, version: int, size: int) -> bytes:
    """Key i's value at `version`: 16 bytes naming both, then bytes only they determine."""
    body = np.random.default_rng(i * 100_003 + version).integers(0, 256, size - 16, dtype=np.uint8).tobytes()
    return i.to_bytes(8, "little") + version.to_bytes(8, "little") + body


def test_reads_racing_overwrites_removes_and_evictions_never_return_wrong_bytes():
    """Keys are removed and put again with new bytes (a new version), and the arena holds a
    quarter of them, so evictions reuse space all the time; every byte of every hit a worker
    returns must be some version of that key's value."""
    pool = start_pool(2, dram="4MiB")
    keys, size, stop_at = 64, 256 << 10, time.monotonic() + 4.0
    versions = [0] * keys
    errors: list[str] = []

    def write() -> None:
        with kvpool.connect(pool.address, use_shm=False) as w:
            rng = np.random.default_rng(1)
            while time.monotonic() < stop_at:
                i = int(rng.integers(keys))
                w.remove(f"h{i}")
                versions[i] += 1
                try:
                    w.put(f"h{i}", _value(i, versions[i], size))
                except KVPoolError:  # DRAM all pinned by readers for a moment
                    pass

    def read(rpc: RpcClient, hits: list[int]) -> None:
        rng = np.random.default_rng(rpc.port ^ os.getpid())
        while time.monotonic() < stop_at:
            i = int(rng.integers(keys))
            got = get(rpc, f"h{i}")
            if got is None:
                continue
            version = int.from_bytes(got[8:16], "little")
            if int.from_bytes(got[:8], "little") != i or got != _value(i, version, size):
                errors.append(f"h{i}: {len(got)} bytes of another object or torn (version {version})")
            hits[0] += 1

    conns = [worker_conn(pool.node.readers.address)[0] for _ in range(3)]
    hits = [[0] for _ in conns]
    threads = [threading.Thread(target=write)] + [threading.Thread(target=read, args=(c, h))
                                                    for c, h in zip(conns, hits)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for c in conns:
            c.close()
        pool.stop()
    assert not errors, errors[:5]
    assert sum(h[0] for h in hits) > 20  # the race was run, not skipped


def test_workers_start_with_the_read_ports_first_get():
    pool = EmbeddedPool(load_settings(port=0, admin_port=0, dram_capacity="64MiB", read_workers=1)).start()
    try:
        readers = pool.node.readers
        with kvpool.connect(pool.address) as same_host:  # reads through shm: no worker is needed
            same_host.put("k", b"v" * 1000)
            assert same_host.get("k") == b"v" * 1000
        time.sleep(0.5)
        assert readers.pids() == []
        with kvpool.connect(pool.address, use_shm=False) as client:
            assert client.get("k") == b"v" * 1000
        deadline = time.monotonic() + 30
        while not readers.pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(readers.pids()) == 1
    finally:
        pool.stop()


def test_workers_off_is_the_node_alone():
    pool = start_pool(0)
    try:
        assert pool.node.readers is None and pool.node.info().read_address is None
        with kvpool.connect(pool.address, use_shm=False) as client:
            client.put("k", b"v" * 70_000)
            assert client.get("k") == b"v" * 70_000
            conn = client._nodes[pool.address]
            assert conn.read_address is None and conn.reader is None
    finally:
        pool.stop()


def test_a_dead_worker_is_replaced_and_its_clients_fall_back_to_the_node(pool):
    with kvpool.connect(pool.address, use_shm=False) as client:
        client.put("k", b"v" * 70_000)
        readers = pool.node.readers
        rpc, pid = worker_conn(readers.address)
        client._nodes[pool.address]._reader = rpc  # this client's read port connection: that worker's
        os.kill(pid, signal.SIGKILL)
        assert client.get("k") == b"v" * 70_000  # the worker is gone: the node answered
        deadline = time.monotonic() + 30
        while (pid in readers.pids() or len(readers.pids()) < 2) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pid not in readers.pids() and len(readers.pids()) == 2
        assert readers.wait_ready(30)
        rpc, _ = worker_conn(readers.address)
        assert get(rpc, "k") == b"v" * 70_000
        rpc.close()


def test_stopping_or_killing_the_node_leaves_no_worker(tmp_path):
    pool = start_pool(2)
    pids = pool.node.readers.pids()
    assert len(pids) == 2 and all(alive(p) for p in pids)
    pool.stop()
    assert not any(alive(p) for p in pids)

    proc = subprocess.Popen([*KVPOOL, "--log-level", "WARNING", "serve", "--port", "0", "--admin-port", "0",
                             "--dram-capacity", "32MiB"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env=clean_env(KVPOOL_READ_WORKERS="2"), text=True)
    try:
        address = proc.stdout.readline().strip().rsplit(" ", 1)[1]
        with kvpool.connect(address, use_shm=False) as client:  # the read port's first get starts them
            client.put("k", b"v")
            assert client.get("k") == b"v"
        deadline = time.monotonic() + 30
        while len(kids := child_pids(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(kids) == 2
        proc.kill()  # no stop, no clean-up: the workers see their stdin end
        proc.wait()
        deadline = time.monotonic() + 10
        while any(alive(p) for p in kids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(p) for p in kids)
    finally:
        stop(proc, 5)


def test_the_read_port_authenticates_and_scopes_keys_as_the_node_does(tmp_path, monkeypatch):
    for name in ("KVPOOL_AUTH_FILE", "KVPOOL_PRINCIPAL"):
        monkeypatch.delenv(name, raising=False)
    roles = {"node": "node", "acme": "tenant:acme", "beta": "tenant:beta"}
    secrets = {name: name[0] * 40 for name in roles}
    ring = tmp_path / "keyring.toml"
    ring.write_text(Keyring.from_dict({"principals": {n: {"role": r, "secret": secrets[n]} for n, r in roles.items()}})
                    .to_toml())
    ring.chmod(0o600)
    acme, beta = Credential("acme", secrets["acme"].encode()), Credential("beta", secrets["beta"].encode())
    pool = start_pool(2, auth_file=str(ring))
    try:
        secret = os.urandom(70_000)
        with kvpool.connect(pool.address, use_shm=False, credential=acme) as client:
            client.put("k", secret)
            assert client.get("k") == secret
            assert client._nodes[pool.address].reader.connected
        address = pool.node.readers.address
        rpc, _ = worker_conn(address, acme)
        assert get(rpc, "k") == secret
        rpc.close()
        rpc, _ = worker_conn(address, beta)  # another tenant: the same key name is another key
        assert get(rpc, "k") is None
        with pytest.raises(KVPoolError):
            get(rpc, "acme\x00k")  # a stored key's form is not a key a tenant may name
        rpc.close()
        # a wrong secret, or no credential at all, is refused by every process on the port
        for _ in range(8):
            with pytest.raises(Unauthorized):
                RpcClient(address, credential=Credential("acme", b"x" * 40)).call(NodeGet(["k"]))
            with socket.create_connection(parse_address(address)) as sock:
                send_frame(sock, NodeGet(["acme\x00k"]))
                sock.settimeout(5)
                answer = b""
                while chunk := sock.recv(1 << 16):
                    answer += chunk
            assert b"unauthorized" in answer and secret[:64] not in answer
    finally:
        pool.stop()
