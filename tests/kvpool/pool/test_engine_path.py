"""The transfer-engine data path of the pool (`data_path="engine"` / "auto"): pins that keep a
read's bytes alive, reservations that never become visible unless committed, the rdma path end
to end (over the FAKE verbs layer of tests/transfer/fake_verbs.py: no RDMA device here), and the
choice of path."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

import kvpool
from etcd_testing import wait_for
from kvpool.config import load_settings
from kvpool.errors import InvalidArgument
from kvpool.master.server import MasterServer
from kvpool.messages import NodeCommit, NodeReserve, PutStart
from kvpool.node import StoreNode
from kvpool.rpc import RpcClient
from kvpool.embedded import EmbeddedPool
from transfer import SegmentDescriptor, TransferEngine

ENGINE_TCP = dict(data_path="engine", transports=("tcp",))


def own():
    """What an engine of ours proves to the pools here, which run unconfigured: the user's own keyring."""
    from kvpool.security.local import local_keyring

    cred = local_keyring().node_credential()
    return cred.principal, cred.secret


def fake_verbs():
    """tests/transfer/fake_verbs.py (a FAKE RDMA device for in-process tests), loaded by path."""
    name = "fake_verbs"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[2] / "transfer" / "fake_verbs.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def settings(**kw):
    return load_settings(port=0, admin_port=0, heartbeat_s=0.2, **{"dram_capacity": "64MiB", **kw})


class EngineWithHook(TransferEngine):
    """A real TransferEngine that first runs a one-shot `before_submit` before moving bytes
    (to act between a read's pin and its transfer)."""

    before_submit = None

    def _fire(self):
        hook, self.before_submit = self.before_submit, None
        if hook is not None:
            hook()

    def submit(self, ops, transport=None):
        self._fire()
        return super().submit(ops, transport)

    def read(self, *args, **kwargs):
        self._fire()
        return super().read(*args, **kwargs)


def test_a_read_never_returns_bytes_of_an_object_evicted_mid_read():
    with EmbeddedPool(settings(dram_capacity="8MiB")) as pool, EngineWithHook(transports=("tcp",), credential=own()) as eng, \
            kvpool.connect(pool.address, data_path="engine", transfer_engine=eng) as reader, \
            kvpool.connect(pool.address, data_path="rpc", use_shm=False) as writer:
        value = os.urandom(1 << 20)
        writer.put("victim", value)

        def remove_and_overwrite():
            # Between the pin and the READ: remove the object and churn the whole arena.
            assert writer.remove("victim")
            assert wait_for(lambda: not pool.node.store.contains("victim"))
            for i in range(12):
                writer.put(f"filler{i}", bytes([i + 1]) * (1 << 20))

        eng.before_submit = remove_and_overwrite
        buf = bytearray(1 << 20)
        assert reader.get_into("victim", buf) == len(value)
        assert buf == value  # the pin kept the old bytes in place
        assert eng.before_submit is None  # the hook did run mid-read
        assert pool.node.store.stats()["total"]["pinned"] == 1  # held until the reader's next request
        assert reader.get("victim") is None  # the unpin rode on this request; the object is gone
        assert pool.node.store.stats()["total"]["pinned"] == 0


@pytest.mark.parametrize("data_path,use_shm", [("rpc", True), ("engine", False)])
def test_remove_right_after_a_get_frees_the_key_for_a_new_put(data_path, use_shm):
    with EmbeddedPool(settings()) as pool, \
            kvpool.connect(pool.address, data_path=data_path, use_shm=use_shm, transports=("tcp",)) as c:
        old, new = os.urandom(100_000), os.urandom(100_000)  # large enough to be pinned, not inlined
        c.put("k", old)
        assert c.get("k") == old  # leaves a pin until the next request to the node
        assert c.remove("k")
        c.put("k", new)  # not AlreadyExists: the pin was released before the remove
        assert c.get("k") == new


def test_auto_uses_rpc_without_rdma_and_engine_over_rdma():
    fv = fake_verbs()
    fabric = fv.FakeFabric()
    node_eng = TransferEngine(transports=("tcp", "rdma"), rdma_device=fv.FakeDevice(fabric, "fake-node")).start()
    client_eng = TransferEngine(transports=("tcp", "rdma"), rdma_device=fv.FakeDevice(fabric, "fake-client")).start()
    try:
        # use_shm=False: a client as on another host (on this one, shm comes before rdma: transfer.route)
        with EmbeddedPool(settings(), transfer_engine=node_eng) as pool, \
                kvpool.connect(pool.address, transfer_engine=client_eng, use_shm=False) as c, \
                kvpool.connect(pool.address, use_shm=False) as plain, \
                kvpool.connect(pool.address, transfer_engine=client_eng) as local:
            assert c.data_paths() == {pool.address: "engine"}  # auto: both ends have rdma
            assert plain.data_paths() == {pool.address: "rpc"}  # auto: no rdma device in this client
            assert local.data_paths() == {pool.address: "shm"}  # same host: shm before rdma
            values = {f"rd{i}": os.urandom(1000 + 70_000 * i) for i in range(8)}
            assert c.put_batch(list(values.items())) == [None] * 8
            posted = sum(fabric.posts.values())
            assert posted >= 8  # the bytes went as one-sided WRITEs
            assert plain.get_batch(list(values)) == list(values.values())
            assert c.get_batch(list(values)) == list(values.values())
            bufs = [bytearray(len(v) + 3) for v in values.values()]
            assert c.get_batch_into(list(values), bufs) == [len(v) for v in values.values()]
            assert [bytes(b[:len(v)]) for b, v in zip(bufs, values.values())] == list(values.values())
            assert sum(fabric.posts.values()) >= posted + 16  # ... and came back as READs
            assert c.get("absent") is None
            with pytest.raises(InvalidArgument):
                c.get_into("rd7", bytearray(10))
    finally:
        client_eng.close()
        node_eng.close()


@pytest.fixture
def cluster():
    base = dict(admin_port=0, heartbeat_s=0.2, put_timeout_s=1.0)
    master = MasterServer(load_settings(port=0, **base)).start()
    nodes = [StoreNode(load_settings(port=0, master=master.address, node_id=f"n{i}", dram_capacity="16MiB",
                                     **base)).start() for i in range(2)]
    assert wait_for(lambda: len(master.service.admin.nodes()) == 2)
    yield master, nodes
    for n in nodes:
        n.stop()
    master.stop()


def _reserve(master_address: str, key: str, size: int):
    rpc = RpcClient(master_address)
    plan = rpc.call(PutStart([key], [size], 1)).plans[0]
    node_rpc = RpcClient(plan.targets[0].address)
    slots = node_rpc.call(NodeReserve([key], [size], [plan.put_id]))
    return rpc, node_rpc, plan, slots


def _node(nodes, node_id):
    return next(n for n in nodes if n.node_id == node_id)


def test_a_reserved_put_that_never_ends_is_reclaimed_on_the_node(cluster):
    master, nodes = cluster
    rpc, node_rpc, plan, slots = _reserve(master.address, "orphan", 4096)
    node = _node(nodes, plan.targets[0].node_id)
    with TransferEngine(transports=("tcp",), credential=own()) as eng:
        eng.write(SegmentDescriptor.from_bytes(slots.segment), slots.results[0].offset, b"z" * 4096)
    with kvpool.connect(master.address, **ENGINE_TCP) as c:
        assert c.get("orphan") is None  # written, never committed: invisible
        assert "orphan" in node.writes.pending()
        assert wait_for(lambda: "orphan" not in node.writes.pending(), timeout=5)  # reclaimed: aborted on the node
        late = node_rpc.call(NodeCommit(["orphan"], [plan.put_id], [True])).results[0]
        assert late.code == "unavailable"  # too late: the writer learns it
        c.put("orphan", b"fresh" * 1000)
        assert c.get("orphan") == b"fresh" * 1000
    rpc.close()
    node_rpc.close()


def test_the_node_aborts_a_reservation_when_its_writer_disconnects(cluster):
    master, nodes = cluster
    rpc, node_rpc, plan, slots = _reserve(master.address, "gone", 1 << 20)
    node = _node(nodes, plan.targets[0].node_id)
    assert "gone" in node.writes.pending() and node.store.stats()["tiers"]["dram"]["used"] >= 1 << 20
    node_rpc.close()
    assert wait_for(lambda: "gone" not in node.writes.pending())
    assert node.store.stats()["tiers"]["dram"]["used"] == 0  # the reservation's space is free again
    with kvpool.connect(master.address, **ENGINE_TCP) as c:
        assert c.get("gone") is None
    rpc.close()


def test_engine_control_messages_reject_bad_input(cluster):
    master, nodes = cluster
    node_rpc = RpcClient(nodes[0].rpc.address)
    with pytest.raises(InvalidArgument):
        node_rpc.call(NodeReserve(["a", "b"], [1], [1, 2]))
    bad = node_rpc.call(NodeReserve(["a", "", "c"], [10, 10, -5], [0, 0, 12345])).results
    assert [r.code for r in bad] == ["invalid_argument"] * 3  # no master in process / bad key / bad size
    unknown = node_rpc.call(NodeCommit(["nothing"], [42], [True])).results[0]
    assert unknown.code == "unavailable"
    assert node_rpc.call(NodeReserve([], [], [])).results == []  # still serving
    node_rpc.close()
    with kvpool.connect(master.address, **ENGINE_TCP) as c:
        c.put("after", b"ok")
        assert c.get("after") == b"ok"


def test_rdma_across_nodes_with_replicas_one_batch_for_every_node():
    fv = fake_verbs()
    fabric = fv.FakeFabric()
    engines = [TransferEngine(transports=("tcp", "rdma"), rdma_device=fv.FakeDevice(fabric, f"fake{i}")).start()
               for i in range(3)]
    base = dict(admin_port=0, heartbeat_s=0.2)
    master = MasterServer(load_settings(port=0, **base)).start()
    nodes = [StoreNode(load_settings(port=0, master=master.address, node_id=f"r{i}", dram_capacity="16MiB", **base),
                       engine=engines[i]).start() for i in range(2)]
    try:
        assert wait_for(lambda: len(master.service.admin.nodes()) == 2)
        with kvpool.connect(master.address, replicas=2, transfer_engine=engines[2],
                            use_shm=False) as c:  # as from another host
            values = {f"rr{i}": os.urandom(50_000 + 1000 * i) for i in range(10)}
            assert c.put_batch(list(values.items())) == [None] * 10
            assert set(c.data_paths().values()) == {"engine"} and len(c.data_paths()) == 2
            assert all(len(master.service.admin.key_info(k)["replicas"]) == 2 for k in values)
            assert c.get_batch(list(values)) == list(values.values())
            nodes[0].stop()  # reads fall over to the other replica
            assert c.get_batch(list(values)) == list(values.values())
            assert sum(fabric.posts.values()) >= 20 + 10
    finally:
        for n in nodes:
            n.stop()
        master.stop()
        for e in engines:
            e.close()
