"""`MasterService`: the pool's metadata service, in process. Synchronous and thread-safe.

Every public method is a plain synchronous call guarded by one lock (`self._lock`); none of them
waits on the network while holding it. Work that talks to nodes (removing bytes of reclaimed,
removed or evicted objects) goes through an outbox drained by a background thread, and each
removal names the put that wrote the copy, so a late removal never deletes a newer object.

Roles: in embedded mode the master is always the leader. In cluster mode `kvpool.cluster` calls
`become_leader` / `become_standby`; a standby raises `NotLeader` from client and node calls, and
a new leader answers `Unavailable` ("recovering") for keys it does not know yet until every node
registered in etcd has re-reported what it holds (or `recovery_s` passes), so a failover never
turns a complete object into a miss.

The class is assembled from mixins, one concept per file: this file holds the client- and
node-facing calls; `admin_ops` the admin API's calls; `housekeeping` reclaim, node timeouts and
eviction; `migration` draining.

Errors: malformed input raises `InvalidArgument` (or `ObjectTooLarge`); an unknown node id or key
in admin calls raises `KeyNotFound`; no room raises `CapacityError` / `AllPinned`.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from typing import Any, Callable, Iterable, Sequence

from kvpool.api import check_key
from kvpool.config import Settings
from kvpool.errors import (AlreadyExists, CapacityError, InvalidArgument, KeyNotFound, NotLeader,
                           ObjectTooLarge, Unavailable)
from kvpool.master.admin_ops import AdminOps
from kvpool.master.housekeeping import Housekeeping
from kvpool.master.migration import Migration
from kvpool.master.placement import choose_nodes
from kvpool.master.tables import COMPLETE, PENDING, NodeEntry, ObjectEntry, Replica
from kvpool.messages import Entry, Held, Location, NodeInfo, Placed, PutPlan, Target

log = logging.getLogger(__name__)

MAX_OBJECT_BYTES = 1 << 32  # protocol-level ceiling; a node's DRAM capacity is usually lower

class MasterService(AdminOps, Housekeeping, Migration):
    """Object table + node table + placement + leases + reclaim + watermark eviction.

    `link_factory(node: NodeEntry)` returns an object with `remove(keys, put_ids)` and `close()`
    that reaches the node (default: an RPC link; the embedded pool passes an in-process one).
    """

    def __init__(self, settings: Settings | None = None, *, link_factory: Callable[[NodeEntry], Any] | None = None,
                 address: str = ""):
        s = settings or Settings()
        self.settings = s
        self.address = address
        self.replicas = s.replicas
        self.put_timeout_s = s.put_timeout_s
        self.lease_s = s.lease_s
        self.node_timeout_s = max(3.0 * s.heartbeat_s, 2.0)
        self.high_watermark = 0.95
        self.low_watermark = 0.85
        self.recovery_s = max(3.0 * s.heartbeat_s, 3.0)
        self._lock = threading.RLock()
        self._objects: dict[str, ObjectEntry] = {}
        self._nodes: dict[str, NodeEntry] = {}
        self._banned: set[str] = set()
        self._migrating: set[str] = set()  # keys with a drain copy in flight
        self._local: set[str] = set()  # nodes in this process (embedded): never timed out
        self._lease_keys: dict[int, tuple[list[str], float]] = {}  # lease id -> (keys, expiry)
        # Unique across failovers: a new leader must never reuse a put id a node still holds.
        self._ids = itertools.count(time.time_ns() // 1000)
        self._links: dict[str, Any] = {}
        self._link_factory = link_factory
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._leader = True
        self.leader_address: str | None = address or None
        self.unix_address: str | None = None  # the RPC server's unix socket, told to clients in hello
        self._awaiting: set[str] = set()  # nodes a new leader waits for
        self._recovering_until = 0.0
        self.counters: dict[str, int] = dict.fromkeys(
            ("puts", "put_bytes", "gets", "hits", "misses", "removes", "evictions", "reclaimed", "nodes_lost"), 0)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "MasterService":
        for target, name in ((self._tick_loop, "master-tick"), (self._outbox_loop, "master-outbox")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        self._outbox.put(None)
        for t in self._threads:
            t.join(timeout=5)
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            try:
                link.close()
            except Exception:  # closing a dead link must not stop shutdown
                log.debug("closing node link failed", exc_info=True)

    @property
    def leader(self) -> bool:
        return self._leader

    def become_leader(self, expected_nodes: Iterable[str] = ()) -> None:
        """Take over: start from empty tables and wait for `expected_nodes` to re-report."""
        with self._lock:
            self._objects.clear()
            self._nodes.clear()
            self._lease_keys.clear()
            self._awaiting = set(expected_nodes)
            self._recovering_until = time.monotonic() + self.recovery_s if self._awaiting else 0.0
            self._leader = True
            self.leader_address = self.address
        log.info("master %s is the leader; waiting for %d node(s) to re-report", self.address, len(self._awaiting))

    def become_standby(self, leader_address: str | None) -> None:
        with self._lock:
            self._leader = False
            self.leader_address = leader_address
            self._objects.clear()
            self._nodes.clear()
            self._lease_keys.clear()

    def recovering(self) -> bool:
        with self._lock:
            return self._recovering_locked(time.monotonic())

    def _recovering_locked(self, now: float) -> bool:
        if self._recovering_until and (now >= self._recovering_until or not self._awaiting):
            self._recovering_until = 0.0
            self._awaiting.clear()
        return bool(self._recovering_until)

    def _check_leader(self) -> None:
        if not self._leader:
            raise NotLeader(f"this master is a standby; the leader is {self.leader_address or 'unknown'}")

    # ------------------------------------------------------------------ node-facing

    def register_node(self, info: NodeInfo, objects: Sequence[Held] = ()) -> None:
        """A node (re-)joins and reports everything it holds; the index is reconciled with it:
        replicas it no longer reports are dropped, reported objects are (re-)added (a removed
        object still waiting for its readers keeps its removal pending)."""
        self._check_leader()
        if info.node_id in self._banned:
            raise InvalidArgument(f"node {info.node_id!r} was removed by an operator; start it with another id")
        now = time.monotonic()
        with self._lock:
            node = self._nodes.get(info.node_id)
            if node is None:
                node = self._nodes[info.node_id] = NodeEntry(node_id=info.node_id, address=info.address)
            elif node.address != info.address:  # restarted elsewhere: the old connection is useless
                link = self._links.pop(node.node_id, None)
                if link is not None:
                    self._outbox.put(("__close__", link, None))
            node.address, node.hostname, node.segments = info.address, info.hostname, list(info.segments)
            node.shm_path, node.capacity = info.shm_path, dict(info.capacity)
            node.transfer_segment = info.transfer_segment
            node.last_heartbeat = now
            reported = {h.key for h in objects}
            for key in [k for k, o in self._objects.items()
                        if node.node_id in o.replicas and o.state == COMPLETE and k not in reported]:
                self._drop_replica_locked(key, node.node_id)
            stale_keys: list[str] = []
            stale_ids: list[int] = []
            for held in objects:
                obj = self._objects.get(held.key)
                if obj is None:
                    obj = ObjectEntry(key=held.key, size=held.size, state=COMPLETE, replicas={}, put_id=held.put_id)
                    self._objects[held.key] = obj
                elif obj.size != held.size or (obj.state == PENDING and obj.put_id != held.put_id):
                    stale_keys.append(held.key)  # another copy won; this one must not linger
                    stale_ids.append(held.put_id)
                    continue
                elif obj.state == PENDING:
                    continue  # its writer will end the put and name this node
                if node.node_id in obj.replicas:
                    obj.replicas[node.node_id].tier = held.tier
                    continue
                obj.replicas[node.node_id] = Replica(node.node_id, held.tier, "", -1)
                node.used += held.size
                node.objects += 1
            if stale_keys:
                self._outbox.put((node.node_id, stale_keys, stale_ids))
            self._awaiting.discard(info.node_id)
        log.info("node %s registered at %s with %d object(s)", info.node_id, info.address, len(objects))

    def heartbeat(self, node_id: str, stats: dict | None = None, dropped: Sequence[Held] = (),
                  moved: Sequence[Held] = ()) -> bool:
        """Record liveness and what the node's own eviction did; False: unknown, register again."""
        self._check_leader()
        with self._lock:
            node = self._nodes.get(node_id)
            if node is None:
                return False
            node.last_heartbeat = time.monotonic()
            if stats:
                node.stats = dict(stats)
            for held in dropped:
                self._drop_replica_locked(held.key, node_id, held.put_id)
            for held in moved:
                obj = self._objects.get(held.key)
                if obj is not None and node_id in obj.replicas:
                    obj.replicas[node_id].tier = held.tier
        return True

    def drop_node(self, node_id: str, reason: str = "lease ended") -> bool:
        """Forget a node and every replica on it (called when its lease or heartbeat ends)."""
        with self._lock:
            return self._drop_node_locked(node_id, reason)

    def mark_local(self, node_id: str) -> None:
        """The node runs in this process (embedded): its liveness is ours, never time it out."""
        with self._lock:
            self._local.add(node_id)

    def known_nodes(self) -> list[str]:
        with self._lock:
            return list(self._nodes)

    # ------------------------------------------------------------------ client-facing

    def put_start(self, key: str, size: int, replicas: int | None = None, writer_node: str = "") -> PutPlan:
        """Plan a put: choose nodes and record a pending object. `exists=True`: already complete."""
        self._check_leader()
        check_key(key)
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise InvalidArgument(f"value size must be a positive integer, got {size!r}")
        want = self.replicas if not replicas else replicas
        if not isinstance(want, int) or want < 1:
            raise InvalidArgument(f"replicas must be >= 1, got {replicas!r}")
        now = time.monotonic()
        with self._lock:
            limit = self._max_object_locked()
            if size > limit:
                raise ObjectTooLarge(f"value of {size} bytes is larger than the largest object a node can hold "
                                     f"({limit} bytes)")
            obj = self._objects.get(key)
            if obj is not None:
                if obj.state == COMPLETE and not obj.removing:
                    return PutPlan(put_id=0, targets=[], exists=True)
                if obj.state == PENDING and obj.deadline > now:
                    raise AlreadyExists(f"key {key!r} is being written by another put")
                if obj.removing:
                    raise AlreadyExists(f"key {key!r} is being removed (a reader holds a lease); retry later")
                self._reclaim_locked(obj)
            chosen = choose_nodes(list(self._nodes.values()), size, want, writer_node)
            if not chosen:
                self._make_room_locked(size, now)
                chosen = choose_nodes(list(self._nodes.values()), size, want, writer_node)
            if not chosen:
                raise CapacityError(f"no store node has room for {size} bytes "
                                    f"({len(self._nodes)} node(s) registered)")
            if len(chosen) < want:
                log.warning("put %r: %d replica(s) requested, only %d node(s) can take it", key, want, len(chosen))
            put_id = next(self._ids)
            self._objects[key] = ObjectEntry(key=key, size=size, state=PENDING,
                                             replicas={n.node_id: Replica(n.node_id) for n in chosen},
                                             put_id=put_id, deadline=now + self.put_timeout_s)
            for n in chosen:
                n.used += size
            return PutPlan(put_id=put_id, targets=[Target(n.node_id, n.address) for n in chosen])

    def put_end(self, key: str, put_id: int, written: Sequence[Placed]) -> None:
        """Publish a put with the replicas that landed; no replica landed = abort."""
        self._check_leader()
        with self._lock:
            obj = self._objects.get(key)
            if obj is not None and obj.state == COMPLETE and obj.put_id == put_id:
                return  # already published (a new leader learned it from the nodes' reports)
            if obj is None or obj.state != PENDING or obj.put_id != put_id:
                for p in written:  # the put was reclaimed or removed meanwhile: its bytes must go
                    self._outbox.put((p.node_id, [key], [put_id]))
                raise Unavailable(f"put of {key!r} was reclaimed or removed before it ended; retry it")
            landed = {p.node_id: p for p in written if p.node_id in obj.replicas and p.node_id in self._nodes}
            for p in written:
                if p.node_id not in landed:  # the node left and came back meanwhile: its copy is unknown
                    self._outbox.put((p.node_id, [key], [put_id]))
            for node_id in list(obj.replicas):
                if node_id not in landed:
                    self._release_space_locked(node_id, obj.size, count=False)
                    del obj.replicas[node_id]
            if not landed:
                del self._objects[key]
                raise Unavailable(f"put of {key!r}: no replica was written")
            for node_id, p in landed.items():
                obj.replicas[node_id] = Replica(node_id, p.tier, p.segment, p.offset)
                self._nodes[node_id].objects += 1
            obj.state = COMPLETE
            obj.deadline = 0.0
            obj.last_access = time.monotonic()
            self.counters["puts"] += 1
            self.counters["put_bytes"] += obj.size

    def expects_write(self, key: str, put_id: int, node_id: str) -> bool:
        """Is `node_id` a target of the pending put `put_id` of `key`? (nodes refuse stray writes)"""
        with self._lock:
            obj = self._objects.get(key)
            return obj is not None and obj.state == PENDING and obj.put_id == put_id and node_id in obj.replicas

    def put_abort(self, key: str, put_id: int) -> None:
        self._check_leader()
        with self._lock:
            obj = self._objects.get(key)
            if obj is not None and obj.state == PENDING and obj.put_id == put_id:
                self._reclaim_locked(obj)

    def lookup(self, keys: Sequence[str], lease: bool = True,
               release: Sequence[int] = ()) -> tuple[int, list[Entry | None]]:
        """Replicas of each complete key (None: a miss) and one lease id covering the hits."""
        self._check_leader()
        now = time.monotonic()
        out: list[Entry | None] = []
        with self._lock:
            if release:
                self._release_locked(release, now)
            lease_id = next(self._ids) if lease else 0
            hit_keys: list[str] = []
            for key in keys:
                obj = self._objects.get(key)
                if obj is None or not obj.visible():
                    if obj is None and self._recovering_locked(now):
                        raise Unavailable("master is recovering after a failover; retry shortly")
                    out.append(None)
                    self.counters["misses"] += 1
                    continue
                locs = [Location(r.node_id, self._nodes[r.node_id].address, r.tier, r.offset)
                        for r in obj.replicas.values() if r.node_id in self._nodes]
                obj.last_access = now
                if lease:
                    obj.leases[lease_id] = now + self.lease_s
                    hit_keys.append(key)
                out.append(Entry(obj.size, locs))
                self.counters["hits"] += 1
            self.counters["gets"] += len(keys)
            if hit_keys:
                self._lease_keys[lease_id] = (hit_keys, now + self.lease_s)
            else:
                lease_id = 0
        return lease_id, out

    def release(self, lease_ids: Sequence[int]) -> None:
        """The reader is done: leases end, deferred removals finish."""
        with self._lock:
            self._release_locked(lease_ids, time.monotonic())

    def is_visible(self, key: str) -> bool:
        with self._lock:
            obj = self._objects.get(key)
            return obj is not None and obj.visible()

    def touch(self, key: str) -> bool:
        """Embedded fast path: visible? and count the access (no lease: the node pins while it reads)."""
        with self._lock:
            obj = self._objects.get(key)
            if obj is None or not obj.visible():
                self.counters["misses"] += 1
                return False
            obj.last_access = time.monotonic()
            self.counters["hits"] += 1
            return True

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._check_leader()
        with self._lock:
            if self._recovering_locked(time.monotonic()) and any(k not in self._objects for k in keys):
                raise Unavailable("master is recovering after a failover; retry shortly")
            return [(o := self._objects.get(k)) is not None and o.visible() for k in keys]

    def match_prefix(self, keys: Sequence[str]) -> int:
        """n such that keys[0..n) are all complete and keys[n] is not."""
        self._check_leader()
        with self._lock:
            recovering = self._recovering_locked(time.monotonic())
            for i, key in enumerate(keys):
                obj = self._objects.get(key)
                if obj is None or not obj.visible():
                    if recovering:
                        raise Unavailable("master is recovering after a failover; retry shortly")
                    return i
            return len(keys)

    def remove(self, keys: Sequence[str]) -> list[bool]:
        """Remove objects; a leased one disappears for readers now and is freed when its leases end."""
        self._check_leader()
        out = []
        now = time.monotonic()
        with self._lock:
            for key in keys:
                obj = self._objects.get(key)
                if obj is None or obj.removing:
                    out.append(False)
                    continue
                if obj.state == PENDING:
                    self._reclaim_locked(obj)
                elif obj.leased(now):
                    obj.removing = True
                    for node_id in obj.replicas:
                        self._hide_local_locked(node_id, obj)
                else:
                    self._delete_locked(obj)
                self.counters["removes"] += 1
                out.append(True)
        return out

    # ------------------------------------------------------------------ internals (lock held)

    def _node_locked(self, node_id: str) -> NodeEntry:
        node = self._nodes.get(node_id)
        if node is None:
            raise KeyNotFound(f"node {node_id!r} not found")
        return node

    def _max_object_locked(self) -> int:
        if not self._nodes:
            raise Unavailable("no store node is registered with the master")
        if len(self._nodes) == 1:  # the embedded pool: every put asks
            for n in self._nodes.values():
                return min(MAX_OBJECT_BYTES, n.capacity.get("dram", 0) or sum(n.capacity.values()))
        dram = max((n.capacity.get("dram", 0) for n in self._nodes.values()), default=0)
        return min(MAX_OBJECT_BYTES, dram or max(n.total_capacity for n in self._nodes.values()))

    def max_object_bytes(self) -> int:
        with self._lock:
            try:
                return self._max_object_locked()
            except Unavailable:
                return MAX_OBJECT_BYTES

    def _release_space_locked(self, node_id: str, size: int, count: bool = True) -> None:
        node = self._nodes.get(node_id)
        if node is not None:
            node.used = max(0, node.used - size)
            if count:
                node.objects = max(0, node.objects - 1)

    def _delete_locked(self, obj: ObjectEntry) -> None:
        """Drop a complete object and queue the removal of its bytes on every replica."""
        del self._objects[obj.key]
        for node_id in obj.replicas:
            self._release_space_locked(node_id, obj.size)
            self._hide_local_locked(node_id, obj)
            self._outbox.put((node_id, [obj.key], [obj.put_id]))

    def _hide_local_locked(self, node_id: str, obj: ObjectEntry) -> None:
        """An in-process node's same-host readers find objects through its shm index without
        asking us: hide a dropped object there now, before the call that dropped it returns
        (its bytes go later, with the queued removal)."""
        if node_id in self._local:
            hide = getattr(self._link(node_id), "hide", None)
            if hide is not None:
                hide([obj.key], [obj.put_id])

    def _reclaim_locked(self, obj: ObjectEntry) -> None:
        """Drop a pending put; its nodes may have committed bytes, which must go."""
        del self._objects[obj.key]
        for node_id in obj.replicas:
            self._release_space_locked(node_id, obj.size, count=False)
            self._hide_local_locked(node_id, obj)
            self._outbox.put((node_id, [obj.key], [obj.put_id]))
        self.counters["reclaimed"] += 1

    def _drop_replica_locked(self, key: str, node_id: str, put_id: int = 0) -> None:
        obj = self._objects.get(key)
        if obj is None or node_id not in obj.replicas or (put_id and obj.put_id != put_id):
            return
        del obj.replicas[node_id]
        self._release_space_locked(node_id, obj.size, count=obj.state == COMPLETE)
        if not obj.replicas:
            del self._objects[key]

    def _drop_node_locked(self, node_id: str, reason: str) -> bool:
        node = self._nodes.pop(node_id, None)
        if node is None:
            return False
        lost = 0
        for key in [k for k, o in self._objects.items() if node_id in o.replicas]:
            obj = self._objects[key]
            del obj.replicas[node_id]
            if not obj.replicas:
                del self._objects[key]
                lost += obj.state == COMPLETE
        link = self._links.pop(node_id, None)
        if link is not None:
            self._outbox.put(("__close__", link, None))
        self.counters["nodes_lost"] += 1
        log.warning("node %s dropped (%s); %d object(s) lost their last replica", node_id, reason, lost)
        return True

    def _release_locked(self, lease_ids: Iterable[int], now: float) -> None:
        for lid in lease_ids:
            for key in self._lease_keys.pop(lid, ((), 0.0))[0]:
                obj = self._objects.get(key)
                if obj is None:
                    continue
                obj.leases.pop(lid, None)
                if obj.removing and not obj.leased(now):
                    self._delete_locked(obj)
