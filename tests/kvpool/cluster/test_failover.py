"""Cluster mode on a real etcd: 2 masters (leader + standby), 2 nodes, SDK clients via etcd://."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

import kvpool
from etcd_testing import spawn, wait_for as poll


def wait_for(pred, timeout=10.0):
    return poll(pred, timeout, step=0.1, retry_on=(kvpool.KVPoolError,))


@pytest.fixture
def cluster(etcd):
    common = ["--port", "0", "--meta", etcd.meta, "--heartbeat-s", "0.3"]
    procs: list = []
    arenas: list[str] = []
    try:
        with ThreadPoolExecutor(4) as ex:  # nodes wait for a leader by themselves
            started = [ex.submit(spawn, ["master", *common, "--admin-port", "0"]) for _ in range(2)]
            started += [ex.submit(spawn, ["node", *common, "--node-id", f"n{i}", "--dram-capacity", "32MiB", "--admin-port", "0"])
                        for i in range(2)]
            procs += [f.result() for f in started]
        masters, nodes = procs[:2], procs[2:]
        client = kvpool.connect(etcd.meta, timeout=15)
        assert wait_for(lambda: len(client.admin("nodes")) == 2)
        arenas = [n["shm_path"] for n in client.admin("nodes")]
        yield client, masters, nodes
        client.close()
    finally:
        for p in procs:
            p.stop()
        for path in arenas:
            if path and os.path.exists(path):
                os.unlink(path)


def test_leader_killed_standby_takes_over_and_nothing_is_lost(cluster):
    client, masters, nodes = cluster
    values = {f"{i:032x}": os.urandom(1000 + 37 * i) for i in range(200)}
    assert client.put_batch(list(values.items())) == [None] * 200
    leader_addr = client.admin("stats")["leader_address"]
    leader = next(m for m in masters if m.address == leader_addr)
    standby = next(m for m in masters if m is not leader)

    leader.kill()
    # The client follows the leader through etcd; the new leader waits for the nodes' reports.
    assert wait_for(lambda: client.admin("stats")["leader_address"] == standby.address, timeout=10)
    assert wait_for(lambda: len(client.admin("keys", limit=10_000)) == 200, timeout=10)
    assert sorted(client.admin("keys", limit=10_000)) == sorted(values)
    assert client.get_batch(list(values)) == list(values.values())
    assert client.match_prefix(list(values)) == 200
    # And it takes new writes.
    client.put("after-failover", b"new leader")
    assert client.get("after-failover") == b"new leader"


def test_a_node_whose_lease_ends_has_its_replicas_dropped(cluster):
    client, masters, nodes = cluster
    values = {f"k{i}": os.urandom(4096) for i in range(40)}
    assert client.put_batch(list(values.items())) == [None] * 40
    holders = {k: client.admin("key_info", key=k)["replicas"][0]["node_id"] for k in values}
    assert set(holders.values()) == {"n0", "n1"}
    victim = nodes[0]
    victim.kill()
    assert wait_for(lambda: [n["node_id"] for n in client.admin("nodes")] == ["n1"], timeout=10)
    for k, v in values.items():
        if holders[k] == "n0":
            assert client.get(k) is None and not client.exists(k)  # dropped from the index: a miss
        else:
            assert client.get(k) == v


def test_clients_see_not_leader_errors_only_as_retries(cluster, etcd):
    client, masters, nodes = cluster
    standby_addr = next(m.address for m in masters if m.address != client.admin("stats")["leader_address"])
    from kvpool.errors import NotLeader

    with pytest.raises(NotLeader):
        kvpool.connect(standby_addr, timeout=0.5)  # a plain address to a standby: a clear typed error
    c2 = kvpool.connect(etcd.meta)
    c2.put("x", b"y")
    assert client.get("x") == b"y"
    c2.close()
