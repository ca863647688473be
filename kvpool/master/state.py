"""`MasterState`: the master's tables and the operations on them that its parts share
(`service`, `admin_ops`, `housekeeping`, `migration` are each given it).

Locking: `lock` guards everything here; `*_locked` methods expect it held and never wait on the
network: work that talks to nodes goes through `outbox`, drained by a background thread, and a
removal names the put that wrote the copy, so it never deletes a newer object.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from typing import Any, Callable, Iterable

from kvpool.security.keyring import load_keyring
from kvpool.config import Settings
from kvpool.errors import KeyNotFound, NotLeader, Unavailable
from kvpool.master.quotas import TenantObjects, check_quota
from kvpool.master.tables import COMPLETE, NodeEntry, ObjectEntry
from kvpool.tiers.tenants import tenant_quotas

log = logging.getLogger("kvpool.master.service")

MAX_OBJECT_BYTES = 1 << 32  # protocol-level ceiling; a node's DRAM capacity is usually lower


class MasterState:
    """`link_factory(node: NodeEntry)` returns an object with `remove(keys, put_ids)`, `copy(keys,
    put_ids, source)` and `close()` that reaches the node (default: an RPC link; the embedded
    pool passes the node itself, which also offers `hide`)."""

    def __init__(self, settings: Settings, link_factory: Callable[[NodeEntry], Any] | None, address: str):
        s = settings
        self.settings = s
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
        # tenant -> (quota_bytes, quota_keys), pool-wide (`kvpool.master.quotas`)
        self.quotas = tenant_quotas(load_keyring(s.auth_file)) if s.auth_file else {}
        self.nodes: dict[str, NodeEntry] = {}
        self.banned: set[str] = set()  # node ids an operator removed
        self.migrating: set[str] = set()  # keys with a drain copy in flight
        self.local: set[str] = set()  # nodes in this process (embedded): never timed out
        self.lease_keys: dict[int, tuple[list[str], float]] = {}  # lease id -> (keys, expiry)
        self.removed: dict[str, dict[int, float]] = {}  # key -> put id -> until: acknowledged removes
        # Keys the housekeeping tick must look at: a put started (may time out), a remove waiting
        # for leases. Candidates, not truth: an entry whose object has moved on is dropped by the
        # tick, so only the two places that make such objects add to them, and no delete needs to
        # remove from them. (Scanning every object twice per tick cost 11 ms of CPU under the lock
        # at 100,000 objects, every 0.5 s: the tail of every call that waited for the lock.)
        self.pending: set[str] = set()
        self.removing: set[str] = set()
        self.removal_order: collections.deque[tuple[float, str, int]] = collections.deque()  # by until
        self.removal_log: Any = None  # cluster mode: `kvpool.cluster.removals.RemovalLog` (etcd)
        # Unique across failovers: a new leader must never reuse a put id a node still holds.
        self.ids = itertools.count(time.time_ns() // 1000)
        self.links: dict[str, Any] = {}
        self.link_factory = link_factory
        # (node_id, keys, put_ids) to remove, ("__close__", link, None), ("__copy__", job, None)
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
            self.outbox.put((node_id, [obj.key], [obj.put_id]))

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
            self.outbox.put((node_id, [obj.key], [obj.put_id]))
        self.counters["reclaimed"] += 1

    def evict_replica_locked(self, obj: ObjectEntry, node_id: str) -> None:
        del obj.replicas[node_id]
        self.release_space_locked(node_id, obj.size)
        self.outbox.put((node_id, [obj.key], [obj.put_id]))
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
            self.outbox.put(("__close__", link, None))
        self.counters["nodes_lost"] += 1
        log.warning("node %s dropped (%s); %d object(s) lost their last replica", node_id, reason, lost)
        return True

    def remember_removal_locked(self, key: str, put_id: int, now: float) -> None:
        until = now + self.removal_memory_s
        self.removed.setdefault(key, {})[put_id] = until
        self.removal_order.append((until, key, put_id))

    def was_removed_locked(self, key: str, put_id: int, now: float) -> bool:
        """Is a node's copy of `key` written by `put_id` one whose remove we acknowledged? A copy
        held since before the node restarted (put id 0) may be any put's: yes if any was removed."""
        removals = self.removed.get(key)
        if not removals:
            return False
        if put_id == 0:
            return any(until > now for until in removals.values())
        return removals.get(put_id, 0.0) > now

    def expire_removals_locked(self, now: float) -> None:
        order = self.removal_order
        while order and order[0][0] <= now:
            _, key, put_id = order.popleft()
            removals = self.removed.get(key)
            if removals is not None and removals.get(put_id, now + 1) <= now:
                del removals[put_id]
                if not removals:
                    del self.removed[key]

    def release_locked(self, lease_ids: Iterable[int], now: float) -> None:
        for lid in lease_ids:
            for key in self.lease_keys.pop(lid, ((), 0.0))[0]:
                obj = self.objects.get(key)
                if obj is None:
                    continue
                obj.leases.pop(lid, None)
                if obj.removing and not obj.leased(now):
                    self.delete_locked(obj)
