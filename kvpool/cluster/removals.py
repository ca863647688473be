"""Tombstones of removes and the id reservation, kept in etcd for the next leader.

A master drops a removed object from its table at once, but the nodes drop their copies later
(its outbox, or when the last reader's lease ends), and a node the master did not know held a
copy (dropped while paused, or not yet re-reported after a failover) is never told. If such a
node re-reports the copy to the next leader, the removed object would come back (found by
issue 14's chaos campaign). So before it answers a remove, found or not, the leader writes a
tombstone `REMOVED_PREFIX<generation, 16 hex digits>/<key>` (no lease), and a new leader reads
them all and refuses the copies they cover in the nodes' re-reports
(`MasterService.register_node`).

Bound: the leader forgets a tombstone `removal_memory_s` after the remove and then `compact`s:
it writes the highest forgotten generation to `HORIZON_KEY`, then deletes every record at or
below it (one range: the names sort by generation). If it dies in between, the next leader
finds the records still there. So etcd, like the leader's memory, holds the removes of about the
last `removal_memory_s`; nodes' marks cover the older ones (`kvpool.master.state`).

Fencing: every write here is a transaction that holds only while the leader key is bound to this
master's election lease, so a deposed leader that has not noticed yet (paused, cut off) can
neither acknowledge a remove the new leader never loaded (it answers `NotLeader`) nor compact
tombstones away.

Ids: a new leader starts its generations above `GENERATION_KEY` and the tombstones, and before it
leads reserves the next `RESERVED` ids there, so ids grow across leaders even when a clock is
behind (a term would need 2^40 ids to outrun its reservation).
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

from kvpool.cluster.etcd import EtcdClient
from kvpool.cluster.membership import LEADER_KEY
from kvpool.errors import NotLeader

REMOVED_PREFIX = "/kvpool/removed/"
HORIZON_KEY = "/kvpool/removed-horizon"
GENERATION_KEY = "/kvpool/generation"
RESERVED = 1 << 40


def _name(generation: int) -> str:
    return f"{REMOVED_PREFIX}{generation:016x}/"


class RemovalLog:
    """`lease()`: the master's current election lease (the fence)."""

    def __init__(self, etcd: EtcdClient, lease: Callable[[], int]):
        self.etcd = etcd
        self.lease = lease

    def _fence(self) -> list[dict]:
        return EtcdClient.lease_is(LEADER_KEY, self.lease())

    def record(self, keys: Iterable[str], generation: int) -> None:
        """Tombstones for `keys` at `generation` (`Unavailable` when etcd cannot be written,
        `NotLeader` when this master no longer holds the leader key)."""
        if not self.etcd.put_many({_name(generation) + k: b"" for k in keys}, compare=self._fence()):
            raise NotLeader("this master lost the leadership before the remove was recorded; retry it")

    def load(self) -> tuple[list[tuple[str, int]], int]:
        """Every (key, generation) tombstone kept, and the horizon below which they were forgotten."""
        out = []
        for name in self.etcd.get_prefix(REMOVED_PREFIX):
            generation, _, key = name[len(REMOVED_PREFIX):].partition("/")
            try:
                out.append((key, int(generation, 16)))
            except ValueError:
                continue
        return out, _int(self.etcd.get(HORIZON_KEY))

    def compact(self, horizon: int) -> None:
        """The leader forgot every tombstone up to `horizon`: so may etcd (one transaction)."""
        horizon = max(horizon, _int(self.etcd.get(HORIZON_KEY)))
        if not self.etcd.txn(self._fence(), {HORIZON_KEY: str(horizon)}, (REMOVED_PREFIX, _name(horizon + 1))):
            raise NotLeader("this master lost the leadership; the next leader compacts")

    def reserve(self, at_least: int) -> int:
        """The first id of a new leader's term: above `at_least`, the clock (microseconds) and every
        earlier term's reservation; the term's `RESERVED` ids are recorded before it starts."""
        start = max(at_least, time.time_ns() // 1000, _int(self.etcd.get(GENERATION_KEY))) + 1
        if not self.etcd.txn(self._fence(), {GENERATION_KEY: str(start + RESERVED)}):
            raise NotLeader("this master lost the leadership while taking over")
        return start


def _int(raw: bytes | None) -> int:
    try:
        return int(raw) if raw else 0
    except ValueError:
        return 0
