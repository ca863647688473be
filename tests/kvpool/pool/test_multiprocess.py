"""Real processes on loopback: `kvpool master`, `kvpool node` x3, client processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import kvpool
from etcd_testing import spawn, wait_for
from kvpool.messages import NodeReserve, NodeWrite, PutStart
from kvpool.rpc import RpcClient
from kvpool.rpc.frame import frame as _frame

WORKER = Path(__file__).with_name("pool_worker.py")


@pytest.fixture
def pool3():
    """1 master + 3 nodes, each its own process."""
    procs = []
    arenas: list[str] = []
    try:
        master = spawn(["master", "--port", "0", "--admin-port", "0", "--heartbeat-s", "0.2"])
        procs.append(master)
        with ThreadPoolExecutor(3) as ex:
            futures = [ex.submit(spawn, ["node", "--port", "0", "--master", master.address, "--node-id", f"node{i}",
                                         "--dram-capacity", "96MiB", "--heartbeat-s", "0.2", "--admin-port", "0"])
                       for i in range(3)]
            procs += [f.result() for f in futures]
        with kvpool.connect(master.address) as c:
            assert wait_for(lambda: len(c.admin("nodes")) == 3)
            arenas = [n["shm_path"] for n in c.admin("nodes")]
        yield master, procs[1:]
    finally:
        for p in procs:
            p.stop()
        for path in arenas:  # a SIGKILLed node cannot unlink its shared-memory arena
            if path and os.path.exists(path):
                os.unlink(path)


def run_workers(address: str, mode: str, seeds: list[int], count: int, data_path: str = "auto") -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, str(WORKER), address, mode, str(s), str(count), data_path],
                              stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for s in seeds]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=240)
        assert p.returncode == 0, f"worker failed: {stdout} {stderr[-2000:]}"
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


@pytest.mark.parametrize("data_path", ["rpc", "engine"])
def test_two_client_processes_put_and_get_1000_chunks_through_three_nodes(pool3, data_path):
    master, nodes = pool3
    puts = run_workers(master.address, "put", [11, 22], 500, data_path)
    assert [r["ok"] for r in puts] == [500, 500]
    # Each client reads back the other's chunks (and its own): every byte must match.
    gets = run_workers(master.address, "get", [22, 11], 500, data_path)
    assert [r["ok"] for r in gets] == [500, 500]
    same_host = "shm" if data_path == "rpc" else data_path  # the rpc option reads a same-host node's shm
    assert all(r["paths"] == [same_host] for r in puts + gets)  # every node was reached that way
    with kvpool.connect(master.address) as c:
        nodes_info = c.admin("nodes")
        assert all(n["objects"] > 0 for n in nodes_info)  # spread over all three nodes
        assert sum(n["objects"] for n in nodes_info) == 1000


@pytest.mark.parametrize("data_path", ["rpc", "engine"])
def test_replicas_2_and_a_node_killed_with_sigkill(pool3, data_path):
    master, nodes = pool3
    with kvpool.connect(master.address, replicas=2, data_path=data_path, transports=("tcp",)) as c:
        values = {f"{i:032x}": os.urandom(2048 + i) for i in range(300)}
        assert c.put_batch(list(values.items())) == [None] * 300
        nodes[0].kill()
        for k, v in values.items():  # before the master notices: the client falls over to the other replica
            assert c.get(k) == v
        assert wait_for(lambda: len(c.admin("nodes")) == 2)
        assert c.get_batch(list(values)) == list(values.values())
        buf = bytearray(5000)
        for k, v in list(values.items())[:20]:
            assert c.get_into(k, buf) == len(v) and bytes(buf[: len(v)]) == v
        assert set(c.data_paths().values()) == {"shm" if data_path == "rpc" else data_path}


def test_a_node_killed_mid_put_leaves_no_visible_object(pool3):
    master, nodes = pool3
    size = 32 << 20
    rpc = RpcClient(master.address)
    plan = rpc.call(PutStart(["half"], [size], 1)).plans[0]
    target = next(n for n in nodes if n.name == plan.targets[0].node_id)
    node_rpc = RpcClient(plan.targets[0].address)
    sock = node_rpc._connect()
    # Send the request and half of the bytes, then kill the node mid-write.
    for part in _frame(NodeWrite(["half"], [size], [plan.put_id]), size):
        sock.sendall(part)
    sock.sendall(b"h" * (size // 2))
    target.kill()
    with kvpool.connect(master.address) as c:
        assert c.get("half") is None and not c.exists("half")
        assert wait_for(lambda: len(c.admin("nodes")) == 2)
        assert c.get("half") is None
        c.put("half", b"a complete object")  # the key is free again
        assert c.get("half") == b"a complete object"
    node_rpc.close()
    rpc.close()


def test_a_client_dying_mid_put_leaves_no_visible_object(pool3):
    master, nodes = pool3
    with kvpool.connect(master.address) as c:
        plan_rpc = RpcClient(master.address)
        size = 4 << 20
        plan = plan_rpc.call(PutStart(["dropped"], [size], 1)).plans[0]
        node_rpc = RpcClient(plan.targets[0].address)
        sock = node_rpc._connect()
        for part in _frame(NodeWrite(["dropped"], [size], [plan.put_id]), size):
            sock.sendall(part)
        sock.sendall(b"d" * (size // 3))
        sock.close()  # the writer is gone; the node aborts its reservation
        plan_rpc.close()
        assert c.get("dropped") is None
        # The put is reclaimed after put_timeout_s; meanwhile the node serves other writes.
        c.put("other", b"fine")
        assert c.get("other") == b"fine"
        assert c.get("dropped") is None


def _reserve_and_write_half(address: str, key: str, size: int, put_id: int, fill: bytes) -> RpcClient:
    """The first half of an engine-path put: reserve at the node, WRITE half of the bytes."""
    from transfer import SegmentDescriptor, TransferEngine

    node_rpc = RpcClient(address)
    slots = node_rpc.call(NodeReserve([key], [size], [put_id]))
    desc = SegmentDescriptor.from_bytes(slots.segment)
    from kvpool.security.local import local_keyring

    own = local_keyring().node_credential()  # the pool runs unconfigured: its user's own keyring
    with TransferEngine(transports=("tcp",), credential=(own.principal, own.secret)) as eng:
        eng.write(desc, slots.results[0].offset, fill * (size // 2))
    return node_rpc


def test_a_node_killed_mid_engine_put_leaves_no_visible_object(pool3):
    master, nodes = pool3
    size = 8 << 20
    rpc = RpcClient(master.address)
    plan = rpc.call(PutStart(["half"], [size], 1)).plans[0]
    target = next(n for n in nodes if n.name == plan.targets[0].node_id)
    node_rpc = _reserve_and_write_half(plan.targets[0].address, "half", size, plan.put_id, b"h")
    target.kill()
    with kvpool.connect(master.address, data_path="engine", transports=("tcp",)) as c:
        assert c.get("half") is None and not c.exists("half")
        assert wait_for(lambda: len(c.admin("nodes")) == 2)
        assert c.get("half") is None
        c.put("half", b"a complete object" * 4000)  # the key is free again
        assert c.get("half") == b"a complete object" * 4000
        assert set(c.data_paths().values()) == {"engine"}
    node_rpc.close()
    rpc.close()


def test_a_client_dying_mid_engine_put_leaves_no_visible_object(pool3):
    master, nodes = pool3
    with kvpool.connect(master.address, data_path="engine", transports=("tcp",)) as c:
        plan_rpc = RpcClient(master.address)
        size = 4 << 20
        plan = plan_rpc.call(PutStart(["dropped"], [size], 1)).plans[0]
        node_rpc = _reserve_and_write_half(plan.targets[0].address, "dropped", size, plan.put_id, b"d")
        node_rpc.close()  # the writer is gone before its commit; the node aborts its reservation
        plan_rpc.close()
        assert c.get("dropped") is None
        c.put("other", b"fine" * 20000)
        assert c.get("other") == b"fine" * 20000
        assert c.get("dropped") is None


@pytest.mark.slow
def test_sdk_puts_racing_a_node_kill_never_return_wrong_bytes(pool3):
    master, nodes = pool3
    results: dict[str, bytes] = {}
    failed: list[str] = []
    stop = threading.Event()

    def writer():
        with kvpool.connect(master.address, replicas=2, timeout=5) as c:
            i = 0
            while not stop.is_set() and i < 400:
                key, value = f"race{i}", os.urandom(256 * 1024)
                try:
                    c.put(key, value)
                    results[key] = value
                except kvpool.KVPoolError:
                    failed.append(key)
                i += 1

    t = threading.Thread(target=writer)
    t.start()
    time.sleep(0.5)
    nodes[1].kill()
    time.sleep(0.5)
    stop.set()
    t.join(timeout=60)
    with kvpool.connect(master.address) as c:
        for key, value in results.items():
            assert c.get(key) == value  # every acknowledged put is readable, byte for byte
        for key in failed:
            got = c.get(key)
            assert got is None or len(got) == 256 * 1024
