"""`MasterState`: the master's tables and the operations on them that its parts share
(`service`, `admin_ops`, `housekeeping`, `migration` are each given it).

Locking: `lock` guards everything here; `*_locked` methods expect it held and never wait on the
network: work that talks to nodes goes through `outbox`, drained by a background thread, and a
removal names the put that wrote the copy, so it never deletes a newer object.

Removes are never undone (issue 29). Put ids, lease ids and remove *generations* come from one
counter (`Generations`) that only grows, across leaders too (a new leader starts above every id
in etcd and every id a node reports). A remove of `key` at generation T leaves a tombstone
`removed[key] = T`: a node's copy of `key` written by put P <= T (or of unknown put, 0) is
refused when reported. Tombstones are kept `removal_memory_s`, then forgotten, raising `horizon`
(every tombstone <= horizon is forgotten). What covers the forgotten ones is each node's *mark*:
the master grants a node mark M (in heartbeat replies) only when every tombstone <= M has been
applied to it: no removal queued or in flight to it, no removed object on it still waiting for
its readers, no put <= M still pending on it, no tombstone <= M still being written to etcd; and
the node refuses any later write of a put <= M (`kvpool.node.writes`). A node reporting with
mark M >= horizon is checked against the tombstones still kept, which is all it can need; one
with M < horizon (away, or a removal to it stuck, for about `removal_memory_s`) cannot be
checked for its copies of puts <= horizon, and those not already known to the master are
refused. So memory is bounded by the removes of the last `removal_memory_s`, and the cost of the
bound is a returning straggler's old copies, never a removed object's return.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from kvpool.security.keyring import load_keyring, ticket_key
from kvpool.security.tickets import Tickets
from kvpool.config import PoolSection, Settings
from kvpool.errors import NotLeader
from kvpool.master.leases import LeaseTable
from kvpool.master.links import Links
from kvpool.master.nodes import NodeTable
from kvpool.master.objects import ObjectTable
from kvpool.master.outbox import CopyObjects, Outbox, RemoveCopies
from kvpool.master.quotas import QuotaTable
from kvpool.master.tables import COMPLETE, PENDING, NodeEntry, ObjectEntry, Replica
from kvpool.master.tombstones import Tombstones
from kvpool.messages import Held
from kvpool.tiers.tenants import tenant_quotas

log = logging.getLogger("kvpool.master.service")


class Generations:
    """The master's id counter: put ids, lease ids, remove generations. `next(gen)` issues one;
    `observe(n)` moves past an id seen elsewhere (a node's report, etcd). Callers hold the lock."""

    def __init__(self, start: int):
        self.last = start

    def __iter__(self) -> "Generations":
        return self

    def __next__(self) -> int:
        self.last += 1
        return self.last

    def observe(self, seen: int) -> None:
        if seen > self.last:
            self.last = seen


@dataclass
class Tunables:
    """Run-time settings; the admin API may change some (`admin_ops.PATCHABLE`)."""

    replicas: int
    put_timeout_s: float
    lease_s: float
    node_timeout_s: float
    recovery_s: float
    high_watermark: float = 0.95
    low_watermark: float = 0.85

    @classmethod
    def of(cls, s: PoolSection) -> "Tunables":
        return cls(replicas=s.replicas, put_timeout_s=s.put_timeout_s, lease_s=s.lease_s,
                   node_timeout_s=max(3.0 * s.heartbeat_s, 2.0), recovery_s=max(3.0 * s.heartbeat_s, 3.0))


class Role:
    """Leader or standby (embedded: always the leader), and a new leader's recovery: until every
    node registered in etcd has re-reported (or `recovery_s` passes) a key it does not know may be
    on a node yet to report, so it answers `Unavailable` rather than a miss. Callers hold the lock."""

    def __init__(self, address: str):
        self.address = address
        self.leader = True
        self.leader_address: str | None = address or None
        self._awaiting: set[str] = set()  # nodes a new leader waits for
        self._until = 0.0

    def check_leader(self) -> None:
        if not self.leader:
            raise NotLeader(f"this master is a standby; the leader is {self.leader_address or 'unknown'}")

    def lead(self, expected: Iterable[str], recovery_s: float, now: float) -> int:
        """Lead, waiting for `expected` nodes to re-report; returns how many."""
        self._awaiting = set(expected)
        self._until = now + recovery_s if self._awaiting else 0.0
        self.leader, self.leader_address = True, self.address
        return len(self._awaiting)

    def stand_by(self, leader_address: str | None) -> None:
        self.leader, self.leader_address = False, leader_address

    def reported(self, node_id: str) -> None:
        self._awaiting.discard(node_id)

    def recovering(self, now: float) -> bool:
        if self._until and (now >= self._until or not self._awaiting):
            self._until = 0.0
            self._awaiting.clear()
        return bool(self._until)


class MasterState:
    """The tables (each owns its invariants: `nodes`, `objects`, `leases`, `tombstones`,
    `quotas`, `outbox`) under the one `lock`, and the operations that span them.

    `link_factory(node: NodeEntry)` returns an object with `remove(keys, put_ids)`, `copy(keys,
    put_ids, source)` and `close()` that reaches the node (default: an RPC link; the embedded
    pool passes the node itself, which also offers `hide`)."""

    def __init__(self, settings: Settings, link_factory: Callable[[NodeEntry], Any] | None, address: str):
        s = settings.pool
        self.settings = settings
        self.tunables = Tunables.of(s)
        self.lock = threading.RLock()
        self.nodes = NodeTable()
        self.objects = ObjectTable(self.nodes)
        self.leases = LeaseTable()
        self.tombstones = Tombstones(s.removal_memory_s)
        self.outbox = Outbox()
        self.links = Links(link_factory, settings)
        self.role = Role(address)
        keyring = load_keyring(settings.security.auth_file) if settings.security.auth_file else None
        self.quotas = QuotaTable(tenant_quotas(keyring) if keyring is not None else None)
        # signs each planned write's ticket for its node (`kvpool.security.tickets`); None: no keyring
        self.tickets = Tickets(ticket_key(keyring.node_credential().secret)) if keyring is not None else None
        self.removal_log: Any = None  # cluster mode: `kvpool.cluster.removals.RemovalLog` (etcd)
        # Unique and growing across failovers: a new leader starts above the old one's reservation in etcd.
        self.ids = Generations(time.time_ns() // 1000)
        self.counters: dict[str, int] = dict.fromkeys(
            ("puts", "put_bytes", "gets", "hits", "misses", "removes", "evictions", "reclaimed", "nodes_lost"), 0)

    def clear_tables_locked(self) -> None:
        """A new role starts from empty tables (a leader rebuilds them from the nodes' reports)."""
        self.objects.clear()
        self.nodes.clear()
        self.leases.clear()
        self.tombstones.clear()
        self.outbox.new_term()

    def link(self, node_id: str) -> Any:
        with self.lock:
            return self.links.get(node_id, self.nodes.get(node_id))

    # -- objects leaving -------------------------------------------------------------------------
    def delete_locked(self, obj: ObjectEntry) -> None:
        """Drop a complete object and queue the removal of its bytes on every replica."""
        for node_id in self.objects.drop(obj):
            self.hide_local_locked(node_id, obj)
            self.outbox.remove(node_id, [obj.key], [obj.put_id])

    def reclaim_locked(self, obj: ObjectEntry) -> None:
        """Drop a pending put; its nodes may have committed bytes, which must go."""
        self.delete_locked(obj)
        self.counters["reclaimed"] += 1

    def evict_replica_locked(self, obj: ObjectEntry, node_id: str) -> None:
        self.objects.drop_replica(obj, node_id)
        self.outbox.remove(node_id, [obj.key], [obj.put_id])
        self.counters["evictions"] += 1

    def drop_replica_locked(self, key: str, node_id: str, put_id: int = 0) -> None:
        """The node no longer holds `key` (of `put_id`, 0: whichever): forget that replica."""
        obj = self.objects.get(key)
        if obj is None or node_id not in obj.replicas or (put_id and obj.put_id != put_id):
            return
        self.objects.drop_replica(obj, node_id)

    def hide_local_locked(self, node_id: str, obj: ObjectEntry) -> None:
        """An in-process node's same-host readers find objects through its shm index without
        asking us: hide a dropped object there now, before the call that dropped it returns
        (its bytes go later, with the queued removal)."""
        if node_id in self.nodes.local:
            hide = getattr(self.link(node_id), "hide", None)
            if hide is not None:
                hide([obj.key], [obj.put_id])

    def release_locked(self, lease_ids: Iterable[int], now: float) -> None:
        """Leases end; a removed object whose last lease this was goes now."""
        for obj in self.leases.end(lease_ids, self.objects.get):
            if obj.removing and not obj.leased(now):
                self.delete_locked(obj)

    # -- nodes -----------------------------------------------------------------------------------
    def drop_node_locked(self, node_id: str, reason: str) -> bool:
        if self.nodes.drop(node_id) is None:
            return False
        lost = self.objects.forget_node(node_id)
        link = self.links.pop(node_id)
        if link is not None:
            self.outbox.close(link)
        self.counters["nodes_lost"] += 1
        log.warning("node %s dropped (%s); %d object(s) lost their last replica", node_id, reason, lost)
        return True

    def done_locked(self, job: RemoveCopies | CopyObjects, failed: bool = False) -> None:
        """An outbox job is over (`failed`: it may not have happened: the node must re-register)."""
        if self.outbox.done(job) and failed:
            self.nodes.mark_dirty(job.node_id)

    def grant_mark_locked(self, node: NodeEntry) -> int:
        """The node's mark (module docstring): raised to the newest generation every tombstone up
        to which has been applied to the node, else left where it was."""
        nid = node.node_id
        if self.outbox.busy(nid) or self.nodes.is_dirty(nid):
            return node.mark
        bound = self.tombstones.bound(self.ids.last)
        for obj in self.objects.pending_on(nid):
            bound = min(bound, obj.put_id - 1)
        for obj in self.objects.removing_on(nid):
            bound = min(bound, self.tombstones.get(obj.key, obj.put_id) - 1)
        node.mark = max(node.mark, bound)
        return node.mark

    def reconcile_locked(self, node: NodeEntry, held: Sequence[Held], mark: int) -> tuple[list[str], list[int]]:
        """The table takes what a (re-)registering node reports holding (`held`): replicas it no
        longer reports are dropped, reported objects are (re-)added (a removed object still
        waiting for its readers keeps its removal pending), except copies a remove covers, or may
        cover (`Tombstones.refused`, given the node's `mark`), and copies older than the object
        known under the key. Returns those (keys, put ids): the node must drop them."""
        nid = node.node_id
        objects = self.objects
        self.ids.observe(mark)
        reported = {h.key for h in held}
        for obj in [o for o in objects.on(nid) if o.key not in reported]:
            objects.drop_replica(obj, nid)
        stale_keys: list[str] = []
        stale_ids: list[int] = []
        for h in held:
            put_id = h.put_id
            self.ids.observe(put_id)
            obj = objects.get(h.key)
            known = (obj is not None and obj.state == COMPLETE and obj.size == h.size
                     and put_id != 0 and put_id == obj.put_id)  # a replica of a live object
            if not known and self.tombstones.refused(h.key, put_id, mark):
                stale_keys.append(h.key)  # removed before this node dropped it (a failover, a pause)
                stale_ids.append(put_id)
                continue
            if obj is not None and obj.state == COMPLETE and put_id and obj.put_id and put_id != obj.put_id:
                # Two puts of one key both live: the older was removed before the newer began.
                if put_id < obj.put_id or obj.removing:
                    stale_keys.append(h.key)
                    stale_ids.append(put_id)
                    continue
                self.delete_locked(obj)  # ours is the newer: the known one's copies go
                obj = None
            if obj is None:
                obj = objects.adopt(h.key, h.size, put_id)
            elif obj.size != h.size or (obj.state == PENDING and obj.put_id != put_id):
                stale_keys.append(h.key)  # another copy won; this one must not linger
                stale_ids.append(put_id)
                continue
            elif obj.state == PENDING:
                continue  # its writer will end the put and name this node
            elif not obj.put_id:
                obj.put_id = put_id  # learned from a copy of unknown put (a restarted node)
            if nid in obj.replicas:
                objects.retier(h.key, nid, h.tier)
                continue
            objects.add_replica(obj, node, Replica(nid, h.tier, "", -1))
        return stale_keys, stale_ids
