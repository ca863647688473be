"""Cluster mode on a real etcd with a keyring (issue 13): masters and nodes authenticate to each
other as the node principal; membership and housekeeping messages (RegisterNode, Heartbeat with
`dropped=`, NodeCopy, NodeRemove) are refused to anyone else, a live node cannot be re-pointed
at another address even by a node principal, and NodeCopy pulls only from registered nodes."""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import kvpool
from kvpool import messages as m
from kvpool.errors import AlreadyExists, Forbidden, Unauthorized
from kvpool.rpc import RpcClient
from pool_auth_support import cred, write_keyring

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kvpool"))
from etcd_testing import EtcdServer, etcd_binary, spawn, wait_for as poll  # noqa: E402


def wait_for(pred, timeout=15.0):
    return poll(pred, timeout, step=0.1, retry_on=(kvpool.KVPoolError,))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if etcd_binary() is None:
        pytest.skip("etcd is not installed (make system-deps)")
    tmp = tmp_path_factory.mktemp("cluster-auth")
    keyring = write_keyring(tmp / "keyring.toml")
    env = {"KVPOOL_AUTH_FILE": str(keyring)}
    procs: list = []
    with EtcdServer(tmp) as etcd:
        common = ["--port", "0", "--meta", etcd.meta, "--heartbeat-s", "0.3", "--admin-port", "0"]
        try:
            with ThreadPoolExecutor(3) as ex:
                started = [ex.submit(spawn, ["master", *common], env=env)]
                started += [ex.submit(spawn, ["node", *common, "--node-id", f"n{i}", "--dram-capacity", "16MiB"],
                                      env=env) for i in range(2)]
                procs += [f.result() for f in started]
            master = procs[0]
            ops = kvpool.connect(master.address, credential=cred("ops"), timeout=15)
            assert wait_for(lambda: len(ops.admin("nodes")) == 2)
            nodes = {n["node_id"]: n["address"] for n in ops.admin("nodes")}
            yield master.address, nodes, ops
            ops.close()
        finally:
            for p in procs:
                p.stop()
            for p in procs[1:]:
                for line in p.output:
                    if "Traceback" in line:
                        raise AssertionError("".join(p.output[-50:]))


def _call(address: str, who: str | None, msg):
    rpc = RpcClient(address, credential=cred(who) if who else None)
    try:
        return rpc.call(msg)
    finally:
        rpc.close()


def test_the_authenticated_cluster_serves_tenants(cluster):
    master, nodes, _ = cluster
    with kvpool.connect(master, credential=cred("acme"), replicas=2) as acme:
        value = os.urandom(300_000)
        acme.put("cluster/key", value)
        assert acme.get("cluster/key") == value
        assert acme.admin("keys") == ["cluster/key"]
    with kvpool.connect(master, credential=cred("beta")) as beta:
        assert beta.get("cluster/key") is None and not beta.exists("cluster/key")
    with pytest.raises(Unauthorized):
        kvpool.connect(master, credential=None, timeout=2)


def test_register_node_cannot_repoint_a_live_node(cluster):
    master, nodes, ops = cluster
    node_id, address = next(iter(nodes.items()))
    hijack = m.RegisterNode(m.NodeInfo(node_id, "127.0.0.1:9", "evil", [f"{node_id}/dram"], None,
                                       {"dram": 1 << 30}), [])
    with pytest.raises(Unauthorized):
        _call(master, None, hijack)
    with pytest.raises(Forbidden):
        _call(master, "acme", hijack)
    with pytest.raises(Forbidden):
        _call(master, "ops", hijack)
    with pytest.raises(AlreadyExists, match="is live"):
        _call(master, "node", hijack)  # even a node principal cannot steal a live node's id
    assert {n["node_id"]: n["address"] for n in ops.admin("nodes")}[node_id] == address


def test_heartbeat_dropped_and_node_remove_refused_to_non_nodes(cluster):
    master, nodes, _ = cluster
    with kvpool.connect(master, credential=cred("acme")) as acme:
        acme.put("cluster/keep", b"k" * 5000)
        node_id = next(iter(nodes))
        drop = m.Heartbeat(node_id, {}, dropped=[m.Held("acme\x00cluster/keep", 5000, "dram", 0)])
        for who in ("acme", "ops"):
            with pytest.raises(Forbidden):
                _call(master, who, drop)
        for address in nodes.values():
            with pytest.raises(Forbidden):
                _call(address, "acme", m.NodeRemove(["cluster/keep"], [0]))
            with pytest.raises(Unauthorized):
                _call(address, None, m.NodeRemove(["acme\x00cluster/keep"], [0]))
        assert acme.get("cluster/keep") == b"k" * 5000


def test_node_copy_only_from_registered_nodes(cluster):
    master, nodes, _ = cluster
    (a_id, a), (b_id, b) = list(nodes.items())
    with pytest.raises(Forbidden):
        _call(a, "acme", m.NodeCopy(["x"], [1], b))
    with pytest.raises(Unauthorized):
        _call(a, None, m.NodeCopy(["x"], [1], b))
    # a node principal naming an address that is no pool node (a port scan, or a fake source)
    with pytest.raises(Forbidden, match="not a registered node"):
        _call(a, "node", m.NodeCopy(["x"], [1], "127.0.0.1:22"))
    with pytest.raises(Forbidden, match="not a registered node"):
        _call(a, "node", m.NodeCopy(["x"], [1], a))
    # from a registered node it runs (the key is absent there: a per-item miss, not a refusal)
    reply = _call(a, "node", m.NodeCopy(["absent"], [1], b))
    assert isinstance(reply.results[0], m.Err) and reply.results[0].code == "not_found"
