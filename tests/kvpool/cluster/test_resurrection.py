"""Issue 29: a remove, once answered, is never undone by a node's late re-report (RELIABILITY.md's
two leftovers of issue 14), on a real etcd with real master and node processes.

Both scenarios make a node hold a copy its master does not know about when the remove is
answered (the node was paused past its etcd lease, so the master dropped it and never sent it a
removal), and let the node come back and re-report that copy: after an election, and later than
the master's `removal_memory_s` (3 s here instead of 60 s, `KVPOOL_REMOVAL_MEMORY_S`).
"""

from __future__ import annotations

import os
import signal
import time

import kvpool
from kvpool.cluster import NODES_PREFIX, EtcdClient
from kvpool.messages import NodeGet
from kvpool.rpc import RpcClient
from etcd_testing import spawn, wait_for as poll

MEMORY_S = 3.0
ENV = {"KVPOOL_REMOVAL_MEMORY_S": str(MEMORY_S)}
# heartbeat 0.5 s: an etcd lease of 2 s, a node silent for 1.5 s is dropped by the master
COMMON = ["--port", "0", "--admin-port", "0", "--heartbeat-s", "0.5"]


def wait_for(pred, timeout=15.0):
    return poll(pred, timeout, step=0.1, retry_on=(kvpool.KVPoolError,))


def _node_holds(address: str, key: str) -> bool:
    rpc = RpcClient(address, timeout=5)
    try:
        return rpc.call(NodeGet([key])).sizes[0] >= 0
    finally:
        rpc.close()


def _node_ids(client) -> list[str]:
    return [n["node_id"] for n in client.admin("nodes")]


def _registered(etcd_client: EtcdClient, node_id: str) -> bool:
    return NODES_PREFIX + node_id in etcd_client.get_prefix(NODES_PREFIX)


def _gone_for_good(client, node, key: str, kept: tuple[str, bytes] | None) -> None:
    """`node` is back and registered and `key` stays a miss: the master refused the copy and
    told the node to drop it. `kept` (another object only the node holds) reads back, proving
    the node re-reported; None: the node re-reported too late for its old copies to be trusted."""
    assert wait_for(lambda: _node_ids(client) == ["n0"]), "the node never registered again"
    if kept is not None:
        assert wait_for(lambda: client.get(kept[0]) == kept[1]), "the node's other object never came back"
    assert client.get(key) is None, "the removed object came back with the node's re-report"
    assert client.exists(key) is False
    assert wait_for(lambda: not _node_holds(node.address, key), timeout=10), "the node was not told to drop it"
    time.sleep(1.0)  # a few more heartbeats and re-registrations: still gone
    assert client.get(key) is None and client.match_prefix([key]) == 0


def test_a_remove_answered_not_found_during_an_election_is_not_undone(etcd):
    """The node is paused past its etcd lease while the leader dies, so the new leader is elected
    expecting no node and answers the remove "not found" (False) at once. The node resumes and
    re-reports the copy: the key must stay removed (the issue-14 chaos run saw it come back)."""
    meta = ["--meta", etcd.meta]
    procs = [spawn(["master", *COMMON, *meta], env=ENV), spawn(["master", *COMMON, *meta], env=ENV)]
    node = spawn(["node", *COMMON, *meta, "--node-id", "n0", "--dram-capacity", "16MiB"], env=ENV)
    procs.append(node)
    etcd_client = EtcdClient(etcd.meta)
    client = kvpool.connect(etcd.meta, use_shm=False, timeout=20)
    paused = False
    try:
        assert wait_for(lambda: _node_ids(client) == ["n0"])
        value, kept = os.urandom(32 << 10), os.urandom(32 << 10)
        client.put("k", value)
        client.put("kept", kept)
        leader_address = client.admin("stats")["leader_address"]
        leader = next(p for p in procs[:2] if p.address == leader_address)
        standby = next(p for p in procs[:2] if p is not leader)

        os.kill(node.pid, signal.SIGSTOP)
        paused = True
        assert wait_for(lambda: not _registered(etcd_client, "n0")), "the node's etcd lease never ended"
        leader.kill()
        assert wait_for(lambda: client.admin("stats")["leader_address"] == standby.address)
        assert client.remove("k") is False  # the new leader knows no copy of it: "not found"
        assert client.get("k") is None

        os.kill(node.pid, signal.SIGCONT)
        paused = False
        _gone_for_good(client, node, "k", ("kept", kept))
    finally:
        if paused:
            os.kill(node.pid, signal.SIGCONT)
        client.close()
        etcd_client.close()
        for p in procs:
            p.stop()


def test_an_acknowledged_remove_is_not_undone_by_a_copy_reported_after_the_removal_memory(etcd):
    """A reader's lease defers the node's removal; the node is paused until its etcd lease ends, so
    the master drops it (and its copy, never sending the removal); the node resumes later than
    `removal_memory_s` after the remove, when the master has forgotten the tombstone, and
    re-reports the copy: the key must stay removed."""
    meta = ["--meta", etcd.meta]
    master = spawn(["master", *COMMON, *meta], env=ENV)
    node = spawn(["node", *COMMON, *meta, "--node-id", "n0", "--dram-capacity", "16MiB"], env=ENV)
    procs = [master, node]
    etcd_client = EtcdClient(etcd.meta)
    client = kvpool.connect(etcd.meta, use_shm=False, timeout=20)
    reader = kvpool.connect(etcd.meta, use_shm=False, timeout=20)
    paused = False
    try:
        assert wait_for(lambda: _node_ids(client) == ["n0"])
        value, kept = os.urandom(32 << 10), os.urandom(32 << 10)
        client.put("k", value)
        client.put("kept", kept)
        assert reader.get("k") == value  # its lease (10 s) defers the node's removal
        assert client.remove("k") is True
        assert client.admin("key_info", key="k")["state"] == "removing"

        os.kill(node.pid, signal.SIGSTOP)
        paused = True
        assert wait_for(lambda: _node_ids(client) == [])  # dropped before the lease ended: no removal sent
        removed_at = time.monotonic()
        assert client.get("k") is None
        time.sleep(max(0.0, removed_at + 2 * MEMORY_S - time.monotonic()))  # past the removal memory

        os.kill(node.pid, signal.SIGCONT)
        paused = False
        _gone_for_good(client, node, "k", None)
        # The price of forgetting tombstones: the node's mark is older than the forgotten ones, so
        # none of its copies the master does not know can be told from removed ones (RELIABILITY.md).
        assert client.get("kept") is None
        assert not _node_holds(node.address, "kept")
    finally:
        if paused:
            os.kill(node.pid, signal.SIGCONT)
        reader.close()
        client.close()
        etcd_client.close()
        for p in procs:
            p.stop()


def test_tombstones_are_forgotten_in_etcd_and_a_failover_after_that_loses_nothing(etcd):
    """The bound's other side: after `removal_memory_s` the leader deletes its tombstones from
    etcd (keeping only the horizon), and nodes that kept heartbeating hold marks above it, so a
    failover afterwards still trusts every copy they re-report."""
    from kvpool.cluster.removals import HORIZON_KEY, REMOVED_PREFIX

    meta = ["--meta", etcd.meta]
    procs = [spawn(["master", *COMMON, *meta], env=ENV), spawn(["master", *COMMON, *meta], env=ENV)]
    procs += [spawn(["node", *COMMON, *meta, "--node-id", f"n{i}", "--dram-capacity", "16MiB"], env=ENV)
              for i in range(2)]
    etcd_client = EtcdClient(etcd.meta)
    client = kvpool.connect(etcd.meta, use_shm=False, timeout=20)
    try:
        assert wait_for(lambda: sorted(_node_ids(client)) == ["n0", "n1"])
        values = {f"v{i}": os.urandom(4096 + i) for i in range(30)}
        assert client.put_batch(list(values.items())) == [None] * 30
        assert client.remove_batch(["v0", "never-written"]) == [True, False]
        assert len(etcd_client.get_prefix(REMOVED_PREFIX)) == 2  # both remembered, found or not
        assert wait_for(lambda: not etcd_client.get_prefix(REMOVED_PREFIX), timeout=4 * MEMORY_S)
        assert int(etcd_client.get(HORIZON_KEY)) > 0
        del values["v0"]

        leader_address = client.admin("stats")["leader_address"]
        next(p for p in procs[:2] if p.address == leader_address).kill()
        assert wait_for(lambda: client.admin("stats")["leader_address"] not in (None, leader_address))
        assert wait_for(lambda: len(client.admin("keys", limit=1000)) == len(values)), "copies were refused"
        assert client.get_batch(list(values)) == list(values.values())
        assert client.get("v0") is None
    finally:
        client.close()
        etcd_client.close()
        for p in procs:
            p.stop()
