"""The etcd client and the leased registration / leader election primitives, on a real etcd."""

from __future__ import annotations

import time

from kvpool.cluster import LEADER_KEY, EtcdClient, LeaderElection, Registration
from kvpool.errors import Unavailable
from etcd_testing import wait_for


def test_create_is_exclusive_and_leases_expire(etcd):
    c = EtcdClient(etcd.meta)
    try:
        lease = c.grant(2)
        assert c.create("/t/x", "one", lease=lease) is True
        assert c.create("/t/x", "two") is False
        assert c.get("/t/x") == b"one"
        c.put("/t/y", "why")
        assert c.get_prefix("/t/") == {"/t/x": b"one", "/t/y": b"why"}
        assert wait_for(lambda: c.get("/t/x") is None, timeout=6)  # no keepalive: the key goes
        assert c.keepalive(lease) == 0
        assert c.get("/t/y") == b"why"
    finally:
        c.close()


def test_registration_stays_while_alive_and_goes_on_stop(etcd):
    c = EtcdClient(etcd.meta)
    reg = Registration(EtcdClient(etcd.meta), "/t/node/a", "addr", ttl=2).start()
    try:
        time.sleep(2.5)  # longer than the TTL: the keepalive thread holds it
        assert c.get("/t/node/a") == b"addr"
    finally:
        reg.stop()
    assert c.get("/t/node/a") is None
    c.close()


class _EtcdLosingOnePut(EtcdClient):
    """A real etcd client whose first put after `arm()` fails as if etcd went away right after
    the lease was granted (the window the chaos campaign hit during an etcd restart)."""

    armed = False

    def put(self, key, value, lease=0):
        if self.armed:
            self.armed = False
            raise Unavailable("etcd went away (injected after the grant)")
        return super().put(key, value, lease=lease)


def test_registration_rewrites_its_key_when_a_put_is_lost_after_the_grant(etcd):
    c = EtcdClient(etcd.meta)
    client = _EtcdLosingOnePut(etcd.meta)
    reg = Registration(client, "/t/node/b", "addr", ttl=2).start()
    try:
        c.revoke(reg.lease)  # the lease is lost (a long pause, an etcd restart): the key goes
        client.armed = True  # and the refresh's put after its new grant is lost too
        assert wait_for(lambda: not client.armed, timeout=5)
        assert wait_for(lambda: c.get("/t/node/b") == b"addr", timeout=5), "the key was never written again"
    finally:
        reg.stop()
        c.close()


def test_one_leader_and_the_standby_takes_over(etcd):
    events: list[tuple[str, str]] = []

    def election(name):
        return LeaderElection(EtcdClient(etcd.meta), name, ttl=2,
                              on_elected=lambda: events.append((name, "elected")),
                              on_standby=lambda leader: events.append((name, f"standby:{leader}")))

    a = election("a:1").start()
    assert wait_for(lambda: a.is_leader)
    b = election("b:2").start()
    assert wait_for(lambda: ("b:2", "standby:a:1") in events)
    assert not b.is_leader
    a.stop()  # revokes its lease: b wins at its next campaign
    assert wait_for(lambda: b.is_leader, timeout=5)
    c = EtcdClient(etcd.meta)
    assert c.get(LEADER_KEY) == b"b:2"
    b.stop()
    c.close()


def test_removal_log_writes_only_while_its_master_holds_the_leader_key(etcd):
    """The fence (issue 29): a deposed leader that has not noticed yet must not acknowledge a
    remove the new leader never loaded, nor compact tombstones away."""
    import pytest

    from kvpool.cluster.removals import HORIZON_KEY, REMOVED_PREFIX, RemovalLog
    from kvpool.errors import NotLeader

    c = EtcdClient(etcd.meta)
    try:
        old, new = c.grant(10), c.grant(10)
        assert c.create(LEADER_KEY, "old:1", lease=old)
        deposed = RemovalLog(c, lambda: old)
        deposed.record(["a"], 5)
        assert deposed.reserve(5) > 5
        assert deposed.load() == ([("a", 5)], 0)
        c.revoke(old)  # its lease ended; another master won the key
        assert c.create(LEADER_KEY, "new:2", lease=new)
        with pytest.raises(NotLeader):
            deposed.record(["b"], 9)
        with pytest.raises(NotLeader):
            deposed.compact(5)
        with pytest.raises(NotLeader):
            deposed.reserve(9)
        leader = RemovalLog(c, lambda: new)
        assert leader.load() == ([("a", 5)], 0)
        leader.record(["b"], 9)
        leader.compact(5)
        assert leader.load() == ([("b", 9)], 5)
        assert list(c.get_prefix(REMOVED_PREFIX)) == [f"{REMOVED_PREFIX}{9:016x}/b"] and c.get(HORIZON_KEY) == b"5"
    finally:
        c.close()


def test_a_client_survives_an_etcd_restart_and_serves_threads_at_once(etcd):
    """Its idle keep-alive connections die with etcd: the next call opens a fresh one instead of
    failing on a dead socket; concurrent callers each get a connection."""
    from concurrent.futures import ThreadPoolExecutor

    c = EtcdClient(etcd.meta)
    try:
        c.put("/t/a", "1")
        etcd.stop()
        etcd.start()
        assert c.get("/t/a") == b"1"  # the first call after the restart
        with ThreadPoolExecutor(8) as ex:
            assert list(ex.map(lambda i: c.put(f"/t/p{i}", str(i)) or c.get(f"/t/p{i}"), range(64))) == \
                [str(i).encode() for i in range(64)]
    finally:
        c.close()
