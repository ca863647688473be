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

import collections
import logging
import queue
import threading
import time
from typing import Any, Callable, Iterable

from kvpool.security.keyring import load_keyring, ticket_key
from kvpool.security.tickets import Tickets
from kvpool.config import Settings
from kvpool.errors import KeyNotFound, NotLeader, Unavailable
from kvpool.master.quotas import TenantObjects, check_quota
from kvpool.master.tables import COMPLETE, PENDING, NodeEntry, ObjectEntry
from kvpool.tiers.tenants import tenant_quotas

log = logging.getLogger("kvpool.master.service")

MAX_OBJECT_BYTES = 1 << 32  # protocol-level ceiling; a node's DRAM capacity is usually lower


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


class MasterState:
    """`link_factory(node: NodeEntry)` returns an object with `remove(keys, put_ids)`, `copy(keys,
    put_ids, source)` and `close()` that reaches the node (default: an RPC link; the embedded
    pool passes the node itself, which also offers `hide`)."""

    def __init__(self, settings: Settings, link_factory: Callable[[NodeEntry], Any] | None, address: str):
        s = settings.pool
        self.settings = settings
        self.address = address
        # run-time tunables (the admin API may change them: `admin_ops.PATCHABLE`)
        self.replicas = s.replicas
        self.put_timeout_s = s.put_timeout_s
        self.lease_s = s.lease_s
        self.node_timeout_s = max(3.0 * s.heartbeat_s, 2.0)
        self.high_watermark = 0.95
        self.low_watermark = 0.85
        self.recovery_s = max(3.0 * s.heartbeat_s, 3.0)
        self.removal_memory_s = s.removal_memory_s  # how long an acknowledged remove is remembered
        self.lock = threading.RLock()
        self.objects: TenantObjects = TenantObjects()  # key -> ObjectEntry, with each tenant's use
        keyring = load_keyring(settings.security.auth_file) if settings.security.auth_file else None
        # tenant -> (quota_bytes, quota_keys), pool-wide (`kvpool.master.quotas`)
        self.quotas = tenant_quotas(keyring) if keyring is not None else {}
        # signs each planned write's ticket for its node (`kvpool.security.tickets`); None: no keyring
        self.tickets = Tickets(ticket_key(keyring.node_credential().secret)) if keyring is not None else None
        self.nodes: dict[str, NodeEntry] = {}
        self.banned: set[str] = set()  # node ids an operator removed
        self.migrating: set[str] = set()  # keys with a drain copy in flight
        self.local: set[str] = set()  # nodes in this process (embedded): never timed out
        self.lease_keys: dict[int, tuple[list[str], float]] = {}  # lease id -> (keys, expiry)
        self.removed: dict[str, int] = {}  # key -> generation of its last remove (a tombstone)
        self.horizon = 0  # every tombstone at or below this generation has been forgotten
        self.horizon_saved = 0  # ... and etcd knows it (cluster mode; `kvpool.cluster.removals`)
        self.recording: set[int] = set()  # generations of removes being written to etcd
        # Removals (and drain copies) queued or in flight to each node, in this term: no mark meanwhile.
        self.busy: dict[str, int] = {}
        self.dirty: set[str] = set()  # nodes a removal failed to reach: no mark until they re-register
        self.term = 0  # a new role's number: work queued in an earlier one does not count in `busy`
        # Keys the housekeeping tick must look at: a put started (may time out), a remove waiting
        # for leases. Candidates, not truth: an entry whose object has moved on is dropped by the
        # tick, so only the two places that make such objects add to them, and no delete needs to
        # remove from them. (Scanning every object twice per tick cost 11 ms of CPU under the lock
        # at 100,000 objects, every 0.5 s: the tail of every call that waited for the lock.)
        self.pending: set[str] = set()
        self.removing: set[str] = set()
        self.removal_order: collections.deque[tuple[float, str, int]] = collections.deque()  # (until, key, T)
        self.removal_log: Any = None  # cluster mode: `kvpool.cluster.removals.RemovalLog` (etcd)
        # Unique and growing across failovers: a new leader starts above the old one's reservation in etcd.
        self.ids = Generations(time.time_ns() // 1000)
        self.links: dict[str, Any] = {}
        self.link_factory = link_factory
        # (node_id, keys, put_ids, term) to remove, ("__close__", link, None, 0), ("__copy__", job, None, term)
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.leader = True
        self.leader_address: str | None = address or None
        self.awaiting: set[str] = set()  # nodes a new leader waits for
        self.recovering_until = 0.0
        self.counters: dict[str, int] = dict.fromkeys(
            ("puts", "put_bytes", "gets", "hits", "misses", "removes", "evictions", "reclaimed", "nodes_lost"), 0)

    def clear_tables_locked(self) -> None:
        """A new role starts from empty tables (a leader rebuilds them from the nodes' reports)."""
        self.objects.clear()
        self.pending.clear()
        self.removing.clear()
        self.nodes.clear()
        self.lease_keys.clear()
        self.removed.clear()
        self.removal_order.clear()
        self.horizon = self.horizon_saved = 0
        self.recording.clear()
        self.busy.clear()
        self.dirty.clear()
        self.term += 1

    def check_leader(self) -> None:
        if not self.leader:
            raise NotLeader(f"this master is a standby; the leader is {self.leader_address or 'unknown'}")

    def recovering_locked(self, now: float) -> bool:
        if self.recovering_until and (now >= self.recovering_until or not self.awaiting):
            self.recovering_until = 0.0
            self.awaiting.clear()
        return bool(self.recovering_until)

    def link(self, node_id: str) -> Any:
        with self.lock:
            link = self.links.get(node_id)
            node = self.nodes.get(node_id)
            if link is None and node is not None:
                factory = self.link_factory
                if factory is None:
                    from kvpool.master.links import RemoteNodeLink
                    from kvpool.rpc.client import node_credential
                    cred = node_credential(self.settings)
                    factory = lambda entry: RemoteNodeLink(entry, credential=cred)  # noqa: E731
                link = self.links[node_id] = factory(node)
            return link

    def node_locked(self, node_id: str) -> NodeEntry:
        node = self.nodes.get(node_id)
        if node is None:
            raise KeyNotFound(f"node {node_id!r} not found")
        return node

    def max_object_locked(self) -> int:
        if not self.nodes:
            raise Unavailable("no store node is registered with the master")
        if len(self.nodes) == 1:  # the embedded pool: every put asks
            for n in self.nodes.values():
                return min(MAX_OBJECT_BYTES, n.capacity.get("dram", 0) or sum(n.capacity.values()))
        dram = max((n.capacity.get("dram", 0) for n in self.nodes.values()), default=0)
        return min(MAX_OBJECT_BYTES, dram or max(n.total_capacity for n in self.nodes.values()))

    def check_quota_locked(self, key: str, size: int, replicas: int) -> None:
        """`QuotaExceeded` when a new object of `key` on `replicas` nodes is past its tenant's quota."""
        if self.quotas:
            check_quota(self.quotas, self.objects, key, size, replicas)

    def release_space_locked(self, node_id: str, size: int, count: bool = True) -> None:
        node = self.nodes.get(node_id)
        if node is not None:
            node.used = max(0, node.used - size)
            if count:
                node.objects = max(0, node.objects - 1)

    def delete_locked(self, obj: ObjectEntry) -> None:
        """Drop a complete object and queue the removal of its bytes on every replica."""
        del self.objects[obj.key]
        for node_id in obj.replicas:
            self.release_space_locked(node_id, obj.size)
            self.hide_local_locked(node_id, obj)
            self.queue_removal_locked(node_id, [obj.key], [obj.put_id])

    def queue_removal_locked(self, node_id: str, keys: list[str], put_ids: list[int]) -> None:
        """Have the outbox remove these copies from `node_id`; the node gets no new mark until done."""
        self.busy[node_id] = self.busy.get(node_id, 0) + 1
        self.outbox.put((node_id, keys, put_ids, self.term))

    def queue_copy_locked(self, target: str, job: tuple) -> None:
        self.busy[target] = self.busy.get(target, 0) + 1
        self.outbox.put(("__copy__", job, None, self.term))

    def done_locked(self, node_id: str, term: int, failed: bool = False) -> None:
        """Outbox work for `node_id` queued in `term` is over (`failed`: it may not have happened)."""
        if term != self.term:
            return
        left = self.busy.get(node_id, 0) - 1
        if left > 0:
            self.busy[node_id] = left
        else:
            self.busy.pop(node_id, None)
        if failed and node_id in self.nodes:
            self.dirty.add(node_id)

    def grant_mark_locked(self, node: NodeEntry) -> int:
        """The node's mark (module docstring): raised to the newest generation every tombstone up
        to which has been applied to the node, else left where it was."""
        nid = node.node_id
        if self.busy.get(nid) or nid in self.dirty:
            return node.mark
        bound = self.ids.last
        if self.recording:
            bound = min(bound, min(self.recording) - 1)
        for key in self.pending:
            obj = self.objects.get(key)
            if obj is not None and obj.state == PENDING and nid in obj.replicas:
                bound = min(bound, obj.put_id - 1)
        for key in self.removing:
            obj = self.objects.get(key)
            if obj is not None and obj.removing and nid in obj.replicas:
                bound = min(bound, self.removed.get(key, obj.put_id) - 1)
        node.mark = max(node.mark, bound)
        return node.mark

    def hide_local_locked(self, node_id: str, obj: ObjectEntry) -> None:
        """An in-process node's same-host readers find objects through its shm index without
        asking us: hide a dropped object there now, before the call that dropped it returns
        (its bytes go later, with the queued removal)."""
        if node_id in self.local:
            hide = getattr(self.link(node_id), "hide", None)
            if hide is not None:
                hide([obj.key], [obj.put_id])

    def reclaim_locked(self, obj: ObjectEntry) -> None:
        """Drop a pending put; its nodes may have committed bytes, which must go."""
        del self.objects[obj.key]
        for node_id in obj.replicas:
            self.release_space_locked(node_id, obj.size, count=False)
            self.hide_local_locked(node_id, obj)
            self.queue_removal_locked(node_id, [obj.key], [obj.put_id])
        self.counters["reclaimed"] += 1

    def evict_replica_locked(self, obj: ObjectEntry, node_id: str) -> None:
        del obj.replicas[node_id]
        self.release_space_locked(node_id, obj.size)
        self.queue_removal_locked(node_id, [obj.key], [obj.put_id])
        self.counters["evictions"] += 1
        if not obj.replicas:
            del self.objects[obj.key]

    def drop_replica_locked(self, key: str, node_id: str, put_id: int = 0) -> None:
        obj = self.objects.get(key)
        if obj is None or node_id not in obj.replicas or (put_id and obj.put_id != put_id):
            return
        del obj.replicas[node_id]
        self.release_space_locked(node_id, obj.size, count=obj.state == COMPLETE)
        if not obj.replicas:
            del self.objects[key]

    def drop_node_locked(self, node_id: str, reason: str) -> bool:
        node = self.nodes.pop(node_id, None)
        if node is None:
            return False
        lost = 0
        for key in [k for k, o in self.objects.items() if node_id in o.replicas]:
            obj = self.objects[key]
            del obj.replicas[node_id]
            if not obj.replicas:
                del self.objects[key]
                lost += obj.state == COMPLETE
        link = self.links.pop(node_id, None)
        if link is not None:
            self.outbox.put(("__close__", link, None, 0))
        self.counters["nodes_lost"] += 1
        log.warning("node %s dropped (%s); %d object(s) lost their last replica", node_id, reason, lost)
        return True

    def remember_removal_locked(self, key: str, generation: int, now: float) -> None:
        """A tombstone: copies of `key` written by puts up to `generation` are removed."""
        if generation > self.removed.get(key, 0):
            self.removed[key] = generation
            self.removal_order.append((now + self.removal_memory_s, key, generation))

    def refused_locked(self, key: str, put_id: int, mark: int) -> bool:
        """Must a node with `mark` drop its copy of `key` written by `put_id` (0: unknown), one its
        master does not know? Yes when a kept tombstone covers it, or when a forgotten one might
        (the node's mark is below the horizon and so is the put)."""
        removed = self.removed.get(key, 0)
        if removed and (put_id == 0 or put_id <= removed):
            return True
        return mark < self.horizon and put_id <= self.horizon

    def expire_removals_locked(self, now: float) -> None:
        """Forget tombstones older than `removal_memory_s`, raising the horizon past them."""
        order = self.removal_order
        while order and order[0][0] <= now:
            _, key, generation = order.popleft()
            if self.removed.get(key) == generation:
                del self.removed[key]
            if generation > self.horizon:
                self.horizon = generation

    def release_locked(self, lease_ids: Iterable[int], now: float) -> None:
        for lid in lease_ids:
            for key in self.lease_keys.pop(lid, ((), 0.0))[0]:
                obj = self.objects.get(key)
                if obj is None:
                    continue
                obj.leases.pop(lid, None)
                if obj.removing and not obj.leased(now):
                    self.delete_locked(obj)
