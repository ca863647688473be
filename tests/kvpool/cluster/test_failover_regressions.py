"""Failover bugs found by issue 14's chaos campaign, each reproduced on a real etcd with real
master and node processes (RELIABILITY.md, "Bugs found and fixed")."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import kvpool
from kvpool.tools.chaos.proxy import FaultProxy
from kvpool.cluster import LEADER_KEY, EtcdClient
from kvpool.cluster.removals import REMOVED_PREFIX
from kvpool.messages import PROTOCOL_VERSION, Hello, NodeGet
from kvpool.rpc import RpcClient
from etcd_testing import free_port, spawn, wait_for


def _is_leader(address: str) -> bool:
    rpc = RpcClient(address, timeout=5)
    try:
        return rpc.call(Hello(PROTOCOL_VERSION, "test")).leader
    finally:
        rpc.close()


def test_a_master_restarted_at_the_dead_leaders_address_waits_for_its_lease(etcd):
    """The leader key names the dead leader's address, which is also the restarted master's:
    it must not lead until the old lease expires and it wins the key under its own lease."""
    # heartbeat 4 s: a lease TTL of 12 s, longer than a restart takes on a loaded machine
    args = ["master", "--port", str(free_port()), "--admin-port", "0", "--meta", etcd.meta, "--heartbeat-s", "4"]
    etcd_client = EtcdClient(etcd.meta)
    procs = [spawn(args)]
    try:
        first = procs[0]
        assert wait_for(lambda: (etcd_client.get_with_lease(LEADER_KEY) or (b"", 0))[0]
                        == first.address.encode())
        old_lease = etcd_client.get_with_lease(LEADER_KEY)[1]
        assert wait_for(lambda: _is_leader(first.address))  # elected: the key, then the tables
        first.kill()
        procs.append(spawn(args))
        restarted = procs[1]
        assert restarted.address == first.address
        standby_answers = 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            leads = _is_leader(restarted.address)
            held = etcd_client.get_with_lease(LEADER_KEY)  # read after: if the old lease holds it now, it did then
            if held is not None and held[1] == old_lease:
                assert not leads, "the restarted master leads while the dead leader's lease holds the key"
                standby_answers += 1
            elif leads:
                break
            time.sleep(0.05)
        assert standby_answers > 0, "the restart came up after the old lease expired: nothing was checked"
        assert leads, "the restarted master never took over after the old lease expired"
        value, lease = etcd_client.get_with_lease(LEADER_KEY)
        assert value == restarted.address.encode() and lease != old_lease
    finally:
        for p in procs:
            p.stop()
        etcd_client.close()


def _node_holds(address: str, key: str) -> bool:
    rpc = RpcClient(address, timeout=5)
    try:
        return rpc.call(NodeGet([key])).sizes[0] >= 0
    finally:
        rpc.close()


def test_a_put_retried_after_its_master_connection_broke_replaces_its_own_first_attempt():
    """PutStart reached the master, the bytes reached the node, the PutEnd was lost with the
    connection: the SDK's retry starts the put again and must not fail with AlreadyExists on
    its own first attempt (still pending until put_timeout_s); the object reads back whole."""
    # heartbeat 2 s: a node is dropped after 6 s silent, longer than it is paused here
    master = spawn(["master", "--port", "0", "--admin-port", "0", "--heartbeat-s", "2"])
    procs = [master]
    proxy = client = None
    try:
        node = spawn(["node", "--port", "0", "--master", master.address, "--node-id", "n0",
                      "--dram-capacity", "16MiB", "--heartbeat-s", "0.5", "--admin-port", "0"])
        procs.append(node)
        watcher = kvpool.connect(master.address, use_shm=False)
        assert wait_for(lambda: len(watcher.admin("nodes")) == 1)
        proxy = FaultProxy(master.address).start()
        client = kvpool.connect(proxy.address, use_shm=False, timeout=10)  # TCP through the proxy
        value = os.urandom(256 << 10)
        outcome: list = []

        def put() -> None:
            try:
                client.put("k", value)
                outcome.append(None)
            except Exception as exc:  # reported by the assertion below
                outcome.append(exc)

        os.kill(node.pid, signal.SIGSTOP)  # the write waits at the node, after PutStart
        try:
            writer = threading.Thread(target=put)
            writer.start()
            assert wait_for(lambda: _key_state(watcher, "k") == "pending", timeout=10)
            proxy.blackhole()  # the PutEnd will go nowhere
        finally:
            os.kill(node.pid, signal.SIGCONT)
        assert wait_for(lambda: _node_holds(node.address, "k"), timeout=10)  # the first attempt's bytes landed
        assert wait_for(lambda: _running(writer, "publish"), timeout=10)  # the client sent its PutEnd...
        time.sleep(0.2)
        assert _key_state(watcher, "k") == "pending"  # ...into the blackhole
        proxy.heal()  # resets the held connection: the PutEnd is lost, the SDK retries the put
        writer.join(timeout=30)
        assert outcome == [None], f"the retried put failed: {outcome}"
        assert watcher.admin("stats")["counters"]["reclaimed"] >= 1  # the first attempt was replaced
        assert client.get("k") == value and watcher.get("k") == value
        time.sleep(1.0)  # the first attempt's removal (naming its put) reaches the node: not the new copy
        assert watcher.get("k") == value
        watcher.close()
    finally:
        if client is not None:
            client.close()
        if proxy is not None:
            proxy.close()
        for p in procs:
            p.stop()


def _key_state(client, key: str) -> str | None:
    try:
        return client.admin("key_info", key=key)["state"]
    except kvpool.KVPoolError:
        return None


def test_an_acknowledged_remove_stays_removed_when_the_leader_dies_before_the_node_dropped_it(etcd):
    """A reader's lease defers the node's removal; the leader dies before it happens; the node
    re-reports the copy to the new leader, which must refuse it: the key stays a miss."""
    common = ["--port", "0", "--admin-port", "0", "--meta", etcd.meta, "--heartbeat-s", "0.5"]  # lease TTL 2 s
    procs = [spawn(["master", *common]), spawn(["master", *common])]
    clients: list = []
    try:
        node = spawn(["node", *common, "--node-id", "n0", "--dram-capacity", "16MiB"])
        procs.append(node)
        writer = kvpool.connect(etcd.meta, use_shm=False, timeout=20)
        clients.append(writer)
        assert wait_for(lambda: len(writer.admin("nodes")) == 1)
        gone, kept = os.urandom(64 << 10), os.urandom(64 << 10)
        writer.put("gone", gone)
        writer.put("kept", kept)
        reader = kvpool.connect(etcd.meta, use_shm=False, timeout=20)
        clients.append(reader)
        assert reader.get("gone") == gone  # its lease (10 s) keeps the node's copy until released
        assert writer.remove("gone") is True
        assert writer.get("gone") is None
        assert writer.admin("key_info", key="gone")["state"] == "removing"
        assert _node_holds(node.address, "gone")  # the node has not dropped it yet
        removals = EtcdClient(etcd.meta)
        assert [k for k in removals.get_prefix(REMOVED_PREFIX) if k.endswith("/gone")]  # remembered in etcd
        removals.close()
        leader_address = writer.admin("stats")["leader_address"]
        leader = next(p for p in procs[:2] if p.address == leader_address)
        leader.kill()
        assert wait_for(lambda: _leader_other_than(writer, leader_address), timeout=15)
        assert writer.get("kept") == kept  # the node re-reported to the new leader
        assert writer.get("gone") is None and writer.exists("gone") is False
        assert wait_for(lambda: not _node_holds(node.address, "gone"), timeout=10)  # told to drop it
        assert writer.get("gone") is None and reader.get("gone") is None
    finally:
        for c in clients:
            c.close()
        for p in procs:
            p.stop()


def _leader_other_than(client, address: str) -> bool:
    try:
        return client.admin("stats")["leader_address"] not in (None, address)
    except kvpool.KVPoolError:
        return False


def _running(thread: threading.Thread, function: str) -> bool:
    """Is `thread` inside a call of `function` now?"""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False
