"""Leased registrations and leader election on etcd, each driven by one daemon thread.

`Registration` keeps one key alive under its own lease; if the lease is lost (a long pause, an
etcd restart) it grants a new one and writes the key again. `LeaderElection` campaigns for
`LEADER_KEY` with a create-if-absent transaction bound to the master's lease: exactly one
master holds the key at a time, and when the leader dies its lease expires and a standby's next
campaign wins. Callbacks run in the election thread.

Identity is the lease, not the address: the key's value (the leader's address) tells clients
and nodes where to go, but a master leads only while the key is bound to its own lease. A master
restarted at its dead predecessor's address finds the key naming "itself" under the old lease,
and stays a standby until that lease expires and it wins the key (found by running deploy/,
docs/deploy.md).
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Callable

from kvpool.cluster.etcd import EtcdClient
from kvpool.errors import KVPoolError, Unavailable

log = logging.getLogger(__name__)

LEADER_KEY = "/kvpool/leader"
MASTERS_PREFIX = "/kvpool/masters/"
NODES_PREFIX = "/kvpool/nodes/"


def leader_address(etcd: EtcdClient) -> str:
    """The leader master's RPC address (`Unavailable` while no master leads)."""
    leader = etcd.get(LEADER_KEY)
    if leader is None:
        raise Unavailable("no leader master in etcd yet")
    return leader.decode()


def lease_ttl(heartbeat_s: float) -> int:
    """Seconds a silent process stays registered: three heartbeats, at least 2 (etcd's floor)."""
    return max(2, math.ceil(3 * heartbeat_s))


class Registration:
    """Keep `key = value` in etcd while this process lives."""

    def __init__(self, etcd: EtcdClient, key: str, value: str, ttl: int):
        self.etcd, self.key, self.value, self.ttl = etcd, key, value, ttl
        self.lease = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"etcd-reg{key}", daemon=True)

    def start(self) -> "Registration":
        self._refresh()
        self._thread.start()
        return self

    def _refresh(self) -> None:
        if self.lease and self.etcd.keepalive(self.lease) > 0:
            return
        # The lease counts as ours only once the key is written under it: a put lost after the
        # grant (etcd restarting) must be retried, not kept alive without its key (found by the
        # chaos campaign, seed 2: a node re-registered with the master every second for 36 s and
        # was dropped each time, its etcd key gone while the orphan lease stayed alive).
        lease = self.etcd.grant(self.ttl)
        self.etcd.put(self.key, self.value, lease=lease)
        self.lease = lease
        log.info("registered %s in etcd (lease %x, ttl %ds)", self.key, self.lease, self.ttl)

    def _loop(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                self._refresh()
            except KVPoolError as exc:
                log.warning("etcd registration of %s: %s", self.key, exc)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            if self.lease:
                self.etcd.revoke(self.lease)
        except KVPoolError:
            pass


class LeaderElection:
    """Campaign for leadership; `on_elected()` / `on_standby(leader)` fire on every change."""

    def __init__(self, etcd: EtcdClient, address: str, ttl: int, on_elected: Callable[[], None],
                 on_standby: Callable[[str | None], None]):
        self.etcd, self.address, self.ttl = etcd, address, ttl
        self.on_elected, self.on_standby = on_elected, on_standby
        self.is_leader = False
        self.leader: str | None = None
        self.lease = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="etcd-election", daemon=True)

    def start(self) -> "LeaderElection":
        self._thread.start()
        return self

    def _step(self) -> None:
        if not self.lease or self.etcd.keepalive(self.lease) <= 0:
            if self.is_leader:
                self._lose("lease expired")
            self.lease = 0  # as in Registration: ours once the key is written under it
            lease = self.etcd.grant(self.ttl)
            self.etcd.put(MASTERS_PREFIX + self.address, self.address, lease=lease)
            self.lease = lease
        current = self.etcd.get_with_lease(LEADER_KEY)
        if current is None and self.etcd.create(LEADER_KEY, self.address, lease=self.lease):
            current = (self.address.encode(), self.lease)
        leader = current[0].decode() if current is not None else None
        mine = current is not None and current[1] == self.lease
        if mine and not self.is_leader:
            self.is_leader, self.leader = True, leader
            log.info("master %s elected leader", self.address)
            self.on_elected()
        elif not mine and (self.is_leader or leader != self.leader):
            if self.is_leader:
                self._lose(f"leader key now held by {leader} (lease {current[1] if current else 0:x})")
            self.leader = leader
            self.on_standby(leader)

    def _lose(self, why: str) -> None:
        log.warning("master %s lost leadership: %s", self.address, why)
        self.is_leader = False
        self.on_standby(None)

    def _loop(self) -> None:
        period = max(0.2, self.ttl / 6)
        while True:
            try:
                self._step()
            except KVPoolError as exc:
                log.warning("leader election: %s", exc)
                if self.is_leader:  # cannot prove we still lead: step down rather than split-brain
                    self._lose(str(exc))
                    self.lease = 0
            if self._stop.wait(period):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            if self.lease:
                self.etcd.revoke(self.lease)  # hands leadership over at once on a clean exit
        except KVPoolError:
            pass
