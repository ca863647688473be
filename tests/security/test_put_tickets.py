"""A tenant's quota holds pool-wide even against writes sent to the nodes directly (issue 27), on a
real cluster: etcd, a master and two nodes, all with the keyring. A node takes a write only under
a put ticket its master signed for that put, key, size and node (`kvpool.security.tickets`): beta
fills its quota through the master, then sends `NodeWrite`s and `NodeReserve`s with invented put
ids, and with genuine tickets bent to another node, size or put, straight to each node; every one
is refused before a byte is stored, while plans from the master keep working (rpc and engine data
paths), and a ticket admits one write only."""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

import kvpool
from kvpool import messages as m
from kvpool.errors import QuotaExceeded
from kvpool.rpc import RpcClient
from pool_auth_support import clean_env, cred, write_keyring

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kvpool"))
from etcd_testing import EtcdServer, etcd_binary, spawn, wait_for as poll  # noqa: E402

OBJ = 128 << 10
QUOTA = 8 * OBJ


def wait_for(pred, timeout=20.0):
    return poll(pred, timeout, step=0.1, retry_on=(kvpool.KVPoolError,))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if etcd_binary() is None:
        pytest.skip("etcd is not installed (make system-deps)")
    tmp = tmp_path_factory.mktemp("tickets")
    keyring = write_keyring(tmp / "keyring.toml", {"beta": {"quota_bytes": QUOTA}})
    env = clean_env(KVPOOL_AUTH_FILE=str(keyring))
    etcd = EtcdServer(tmp).start()
    common = ["--port", "0", "--heartbeat-s", "0.3", "--meta", etcd.meta]
    procs: list = []
    try:
        with ThreadPoolExecutor(3) as ex:
            started = [ex.submit(spawn, ["master", *common, "--admin-port", "0"], env=env)]
            started += [ex.submit(spawn, ["node", *common, "--node-id", f"n{i}", "--dram-capacity", "16MiB", "--admin-port", "0"],
                                  env=env, log_level="INFO") for i in range(2)]
            procs += [f.result() for f in started]
        ops = kvpool.connect(procs[0].address, credential=cred("ops"), timeout=15)
        assert wait_for(lambda: len(ops.admin("nodes")) == 2)
        nodes = {n["node_id"]: n["address"] for n in ops.admin("nodes")}
        yield SimpleNamespace(address=procs[0].address, ops=ops, nodes=nodes, procs=procs)
        ops.close()
    finally:
        for p in procs:
            p.stop()
        etcd.stop()
        for p in procs:
            assert not any("Traceback" in line for line in p.output), "".join(p.output[-50:])


def node_rpc(cluster, node_id: str, who: str = "beta") -> RpcClient:
    return RpcClient(cluster.nodes[node_id], credential=cred(who))


def stored_on(cluster, node_id: str, key: str) -> bool:
    rpc = node_rpc(cluster, node_id)
    try:
        return rpc.call(m.NodeGet([key])).sizes[0] >= 0
    finally:
        rpc.close()


def test_a_tenant_cannot_write_past_its_quota_by_writing_to_the_nodes_directly(cluster):
    value = os.urandom(OBJ)
    with kvpool.connect(cluster.address, credential=cred("beta"), replicas=1) as beta:
        for i in range(8):
            beta.put(f"own/{i}", value)
        with pytest.raises(QuotaExceeded):
            beta.put("own/8", value)
        for node_id in cluster.nodes:
            rpc = node_rpc(cluster, node_id)
            try:
                for i in range(4):  # invented put ids: each node alone would take up to the quota
                    key = f"direct/{node_id}/{i}"
                    res = rpc.call(m.NodeWrite([key], [OBJ], [10 ** 15 + i]), [value]).results[0]
                    assert isinstance(res, m.Err) and res.code == "forbidden", res
                    assert "no put ticket" in res.message
                    slot = rpc.call(m.NodeReserve([key + "/r"], [OBJ], [10 ** 15 + i])).results[0]
                    assert isinstance(slot, m.Err) and slot.code == "forbidden", slot
            finally:
                rpc.close()
            assert not any(stored_on(cluster, node_id, f"direct/{node_id}/{i}") for i in range(4))
        assert beta.get_batch([f"own/{i}" for i in range(8)]) == [value] * 8
        assert beta.remove_batch([f"own/{i}" for i in range(8)]) == [True] * 8


def test_a_ticket_admits_exactly_its_write_once(cluster):
    master = RpcClient(cluster.address, credential=cred("beta"))
    value = os.urandom(OBJ)
    try:
        plan = master.call(m.PutStart(["ticketed"], [OBJ], replicas=1)).plans[0]
        assert isinstance(plan, m.PutPlan) and plan.targets[0].ticket, plan
        target = plan.targets[0]
        other = next(n for n in cluster.nodes if n != target.node_id)
        bent = {
            "another node": (other, "ticketed", OBJ, plan.put_id),
            "another size": (target.node_id, "ticketed", OBJ // 2, plan.put_id),
            "another key": (target.node_id, "not-ticketed", OBJ, plan.put_id),
            "another put": (target.node_id, "ticketed", OBJ, plan.put_id + 1),
        }
        for why, (node_id, key, size, put_id) in bent.items():
            rpc = node_rpc(cluster, node_id)
            try:
                res = rpc.call(m.NodeWrite([key], [size], [put_id], tickets=[target.ticket]), [value[:size]])
                assert isinstance(res.results[0], m.Err) and "does not admit this write" in res.results[0].message, why
            finally:
                rpc.close()
        forged = target.ticket[:-1] + bytes([target.ticket[-1] ^ 1])
        rpc = node_rpc(cluster, target.node_id)
        try:
            res = rpc.call(m.NodeWrite(["ticketed"], [OBJ], [plan.put_id], tickets=[forged]), [value]).results[0]
            assert isinstance(res, m.Err) and res.code == "forbidden"
            placed = rpc.call(m.NodeWrite(["ticketed"], [OBJ], [plan.put_id], tickets=[target.ticket]), [value])
            assert isinstance(placed.results[0], m.Placed), placed
            assert master.call(m.PutEnd(["ticketed"], [plan.put_id], [placed.results])).errors == [None]
            with kvpool.connect(cluster.address, credential=cred("beta")) as beta:
                assert beta.get("ticketed") == value
                assert beta.remove("ticketed")
            assert wait_for(lambda: not stored_on(cluster, target.node_id, "ticketed"))
            again = rpc.call(m.NodeWrite(["ticketed"], [OBJ], [plan.put_id], tickets=[target.ticket]), [value])
            assert isinstance(again.results[0], m.Err) and "already used" in again.results[0].message
            assert not stored_on(cluster, target.node_id, "ticketed")
        finally:
            rpc.close()
    finally:
        master.close()


@pytest.mark.parametrize("data_path", ["rpc", "engine"])
def test_puts_planned_by_the_master_carry_their_tickets(cluster, data_path):
    values = {f"{data_path}/{i}": os.urandom(OBJ) for i in range(4)}
    with kvpool.connect(cluster.address, credential=cred("acme"), replicas=2, data_path=data_path,
                        transports=["tcp"]) as acme:
        assert acme.put_batch(list(values.items())) == [None] * 4
        assert acme.get_batch(list(values)) == list(values.values())
        for key in values:
            assert len(cluster.ops.admin("key_info", key="acme\x00" + key)["replicas"]) == 2
        assert acme.remove_batch(list(values)) == [True] * 4


def test_the_refusals_are_logged(cluster):
    text = "".join(line for p in cluster.procs[1:] for line in p.output)
    assert "refused a write of" in text and "no put ticket" in text
