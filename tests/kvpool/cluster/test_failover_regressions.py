"""Failover bugs found by issue 14's chaos campaign, each reproduced on a real etcd with real
master and node processes (RELIABILITY.md, "Bugs found and fixed")."""

from __future__ import annotations

from kvpool.cluster import LEADER_KEY, EtcdClient
from kvpool.messages import PROTOCOL_VERSION, Hello
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
    args = ["master", "--port", str(free_port()), "--meta", etcd.meta, "--heartbeat-s", "2"]  # lease TTL 6 s
    etcd_client = EtcdClient(etcd.meta)
    procs = [spawn(args)]
    try:
        first = procs[0]
        assert wait_for(lambda: (etcd_client.get_with_lease(LEADER_KEY) or (b"", 0))[0] == first.address.encode())
        old_lease = etcd_client.get_with_lease(LEADER_KEY)[1]
        assert _is_leader(first.address)
        first.kill()
        procs.append(spawn(args))
        restarted = procs[1]
        assert restarted.address == first.address
        standby_answers = 0
        for _ in range(400):
            leads = _is_leader(restarted.address)
            held = etcd_client.get_with_lease(LEADER_KEY)  # read after: if the old lease holds it now, it did then
            if held is not None and held[1] == old_lease:
                assert not leads, "the restarted master leads while the dead leader's lease holds the key"
                standby_answers += 1
            elif leads:
                break
            wait_for(lambda: False, timeout=0.05)
        assert standby_answers > 0, "the restart came up after the old lease expired: nothing was checked"
        assert leads, "the restarted master never took over after the old lease expired"
        value, lease = etcd_client.get_with_lease(LEADER_KEY)
        assert value == restarted.address.encode() and lease != old_lease
    finally:
        for p in procs:
            p.stop()
        etcd_client.close()
