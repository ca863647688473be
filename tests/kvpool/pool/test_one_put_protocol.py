"""One put protocol: an embedded pool's puts are the cluster's (`PutStart`, a write under the
granted put id, `PutEnd`), answered in its process; a write under no put (put id 0) is refused
everywhere. And one "same host": a node's published host id, nothing else."""

from __future__ import annotations

import os
import socket

import pytest

import kvpool
from etcd_testing import wait_for
from kvpool.client.nodes import NodeConn
from kvpool.config import load_settings
from kvpool.embedded import EmbeddedPool
from kvpool.master.server import MasterServer
from kvpool.master.service import MasterService
from kvpool.client.datapath import DataPaths
from kvpool.messages import (PROTOCOL_VERSION, Err, Hello, NodeReserve, NodeStats, NodeWrite, Placed, Put, PutPlan,
                             PutStart)
from kvpool.node import StoreNode
from kvpool.node.writes import Writes
from kvpool.rpc import RpcClient
from kvpool.rpc.frame import HEADER, encoder
from transfer import local_host_id

BASE = dict(admin_port=0, heartbeat_s=0.2, put_timeout_s=2.0)


@pytest.fixture(params=["embedded", "cluster"])
def pool_address(request):
    if request.param == "embedded":
        pool = EmbeddedPool(load_settings(port=0, dram_capacity="64MiB", **BASE)).start()
        yield pool.address
        pool.stop()
        return
    master = MasterServer(load_settings(port=0, **BASE)).start()
    node = StoreNode(load_settings(port=0, master=master.address, node_id="n0", dram_capacity="64MiB",
                                   **BASE)).start()
    assert wait_for(lambda: len(master.service.admin.nodes()) == 1)
    yield master.address
    node.stop()
    master.stop()


@pytest.fixture
def steps(monkeypatch):
    """What the master and the node are asked, in order: ("start", key, token, put id),
    ("write", key, put id) for a NodeWrite's or a NodeReserve's object, ("end", key, put id, landed)."""
    seen: list[tuple] = []
    start, end, write, open_ = MasterService.put_start, MasterService.put_end, Writes.write, Writes.open

    def put_start(self, key, size, replicas=None, writer_node="", token=0):
        plan = start(self, key, size, replicas, writer_node, token)
        seen.append(("start", key, token, plan.put_id))
        return plan

    def put_end(self, key, put_id, written):
        seen.append(("end", key, put_id, len(written)))
        return end(self, key, put_id, written)

    def node_write(self, key, size, put_id, *args, **kwargs):
        seen.append(("write", key, put_id))
        return write(self, key, size, put_id, *args, **kwargs)

    def node_open(self, key, size, put_id, *args, **kwargs):
        seen.append(("write", key, put_id))
        return open_(self, key, size, put_id, *args, **kwargs)

    monkeypatch.setattr(MasterService, "put_start", put_start)
    monkeypatch.setattr(MasterService, "put_end", put_end)
    monkeypatch.setattr(Writes, "write", node_write)
    monkeypatch.setattr(Writes, "open", node_open)
    return seen


@pytest.mark.parametrize("data_path,use_shm", [("rpc", True), ("rpc", False), ("engine", False)])
def test_embedded_and_cluster_puts_take_the_same_steps(pool_address, steps, data_path, use_shm):
    with kvpool.connect(pool_address, data_path=data_path, use_shm=use_shm, transports=("tcp",)) as c:
        value = os.urandom(70_000)
        steps.clear()
        c.put("k", value)
        assert c.get("k") == value
        start, write, end = steps
        assert start[:2] == ("start", "k") and start[2] != 0 and start[3] != 0  # the client's token, a granted put
        assert write == ("write", "k", start[3])
        assert end == ("end", "k", start[3], 1)
        steps.clear()
        c.put("k", b"other")  # complete already: started, found, nothing written or ended
        assert [s[0] for s in steps] == ["start"] and c.get("k") == value


@pytest.mark.parametrize("data_path", ["rpc", "engine"])
def test_the_messages_of_a_put_embedded_in_one_or_three_round_trips_cluster_in_three_or_five(
        pool_address, monkeypatch, data_path):
    sent: list[str] = []
    send = RpcClient.send_request

    def counted(self, msg, buffers=()):
        sent.append(type(msg).__name__)
        return send(self, msg, buffers)

    monkeypatch.setattr(RpcClient, "send_request", counted)
    with kvpool.connect(pool_address, data_path=data_path, use_shm=False, transports=("tcp",)) as c:
        c.put("warm", b"w" * 5000)  # connections made, paths chosen
        sent.clear()
        c.put("k", os.urandom(50_000))
        expected = {("embedded", "rpc"): ["Put"],
                    ("embedded", "engine"): ["PutReserve", "PutCommit"],  # and the WRITE, on the transfer engine
                    ("cluster", "rpc"): ["PutStart", "NodeWrite", "PutEnd"],
                    ("cluster", "engine"): ["PutStart", "NodeReserve", "NodeCommit", "PutEnd"]}
        assert sent == expected[("embedded" if c.embedded else "cluster", data_path)]


@pytest.mark.parametrize("kind", ["write", "reserve"])
def test_a_write_under_no_put_is_refused(pool_address, kind):
    with kvpool.connect(pool_address) as c:
        node = c.admin("nodes")[0]["address"]  # embedded: the pool's own address
    rpc = RpcClient(node)
    try:
        if kind == "write":
            res = rpc.call(NodeWrite(["nobody"], [4096], [0]), [b"x" * 4096]).results[0]
        else:
            res = rpc.call(NodeReserve(["nobody"], [4096], [0])).results[0]
        assert isinstance(res, Err) and res.code == "invalid_argument" and "put id 0" in res.message, res
    finally:
        rpc.close()
    with kvpool.connect(pool_address) as c:
        assert c.get("nobody") is None
        c.put("nobody", b"y" * 4096)  # the refused write left nothing behind
        assert c.get("nobody") == b"y" * 4096


def test_an_embedded_Put_is_PutStart_so_its_retry_replaces_its_first_attempt():
    with EmbeddedPool(load_settings(port=0, dram_capacity="64MiB", **BASE)) as pool:
        rpc = RpcClient(pool.address)
        try:
            first = rpc.call(PutStart(["t"], [8], token=77)).plans[0]  # an attempt whose writer went quiet
            assert isinstance(first, PutPlan) and first.put_id
            other = rpc.call(Put(["t"], [8], token=78), [b"a" * 8]).results[0]
            assert isinstance(other, Err) and other.code == "already_exists"  # another put's: refused
            again = rpc.call(Put(["t"], [8], token=77), [b"b" * 8]).results[0]
            assert isinstance(again, Placed) and again.offset >= 0  # the retry replaced it
            done = rpc.call(Put(["t"], [8], token=79), [b"c" * 8]).results[0]
            assert isinstance(done, Placed) and done.offset == -1 and not done.tier  # complete: nothing written
        finally:
            rpc.close()
        with kvpool.connect(pool.address) as c:
            assert c.get("t") == b"b" * 8


def test_an_embedded_Put_cut_mid_payload_ends_its_put(monkeypatch):
    monkeypatch.setenv("KVPOOL_LOCAL_AUTH", "off")  # a raw socket speaks no authentication hello
    # a put timeout far away: only the Put's own end can take the pending put out of the table
    with EmbeddedPool(load_settings(port=0, dram_capacity="64MiB", **{**BASE, "put_timeout_s": 60.0})) as pool:
        size = 4 << 20
        sock = socket.create_connection((pool.rpc.host, pool.rpc.port))
        body = encoder.encode(Put(["cut"], [size], token=5))
        sock.sendall(HEADER.pack(PROTOCOL_VERSION, 0, len(body), size) + body + b"z" * (size // 2))
        assert wait_for(lambda: "cut" in pool.master.state.objects._entries)  # started, being written
        sock.close()
        assert wait_for(lambda: "cut" not in pool.master.state.objects._entries)  # ended with nothing landed
        with kvpool.connect(pool.address) as c:
            assert c.get("cut") is None
            c.put("cut", b"whole")  # no pending put in the way
            assert c.get("cut") == b"whole"


def test_servers_publish_their_host_id_and_a_node_of_another_host_is_reached_over_tcp():
    with EmbeddedPool(load_settings(port=0, dram_capacity="64MiB", **BASE)) as pool:
        with kvpool.connect(pool.address) as c:
            assert c.data_paths() == {pool.address: "shm"}
        info = pool.node.info()
        assert info.host_id == local_host_id()
        rpc = RpcClient(pool.address)
        try:
            assert rpc.call(NodeStats()).doc["host_id"] == local_host_id()
            assert rpc.call(Hello(PROTOCOL_VERSION)).host_id == local_host_id()
        finally:
            rpc.close()
        # the arena's file opens here, the host name matches: only the host id says "elsewhere"
        elsewhere = f"{socket.gethostname()}:another-boot"
        conn = NodeConn(pool.address, use_shm=True, shm_path=info.shm_path, host_id=elsewhere,
                        arena_size=info.capacity["dram"], segment=info.transfer_segment, index_path=info.index_path)
        try:
            assert not conn.shm and conn.index is None and conn.rpc.unix is None
            paths = DataPaths()
            assert paths.choose(conn).name == "rpc"
            paths.close()
        finally:
            conn.close()
