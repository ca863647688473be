"""The master's background work, given the shared `MasterState`.

- `tick()` (every min(0.5 s, heartbeat)): reclaim pending puts past their deadline, finish
  removals whose leases ended, forget tombstones older than `removal_memory_s` (and tell etcd,
  `save_horizon`), drop
  nodes silent for `node_timeout_s` (embedded nodes excepted), plan drain copies
  (`kvpool.master.migration`), and evict least-recently-used unleased replicas from any node
  above `high_watermark` of its capacity down to `low_watermark`.
- the outbox thread (`outbox_loop`): runs the outbox's jobs (`kvpool.master.outbox`) outside the
  lock: removes the bytes of dropped objects on their nodes, each removal naming the put that
  wrote the copy; runs drain copies; closes links. A removal that fails marks the node dirty (it
  must re-register).
- `make_room_locked`: when no node can take a new object, evict LRU unleased replicas from
  the roomiest node; `AllPinned` when only leased objects stand in the way.
Eviction order is the master's own access recency (it sees every lookup), fair across tenants
(`fair_order`: the least recently used object of the tenant holding the most bytes on that node
goes first, so one tenant's flood evicts its own objects before another's working set); each
node's store additionally evicts by its own policy (fair too, `kvpool.tiers.policy.FairPolicy`)
under local pressure and reports it.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from typing import Any, Iterable, Iterator

from kvpool.errors import AllPinned, KVPoolError
from kvpool.master.migration import Migration
from kvpool.master.outbox import CloseLink, CopyObjects, RemoveCopies, Stop
from kvpool.master.state import MasterState
from kvpool.master.tables import NODE_UP
from kvpool.security.tenancy import tenant_of

log = logging.getLogger("kvpool.master.service")


def fair_order(objects: Iterable[Any]) -> Iterator[Any]:
    """`objects` (with `key`, `size`, `last_access`) in eviction order: each next one is the least
    recently used of the tenant that holds the most bytes among those not yet yielded."""
    by_tenant: dict[str, list[Any]] = {}
    for obj in objects:
        by_tenant.setdefault(tenant_of(obj.key), []).append(obj)
    if len(by_tenant) == 1:  # one tenant (authentication off): plain LRU
        yield from sorted(next(iter(by_tenant.values())), key=lambda o: o.last_access)
        return
    heap = []
    for tenant, objs in by_tenant.items():
        objs.sort(key=lambda o: o.last_access, reverse=True)  # pop() gives the oldest
        heap.append((-sum(o.size for o in objs), tenant))
    heapq.heapify(heap)
    while heap:
        neg_bytes, tenant = heapq.heappop(heap)
        obj = by_tenant[tenant].pop()
        yield obj
        if by_tenant[tenant]:
            heapq.heappush(heap, (neg_bytes + obj.size, tenant))


class Housekeeping:
    def __init__(self, state: MasterState, migration: Migration):
        self.state = state
        self.migration = migration

    def make_room_locked(self, size: int, now: float) -> None:
        """No node has `size` free: evict LRU unleased objects from the roomiest node."""
        st = self.state
        candidates = [n for n in st.nodes if n.state == NODE_UP and n.total_capacity >= size]
        if not candidates:
            return
        node = max(candidates, key=lambda n: n.free)
        pinned = False
        for obj in fair_order(st.objects.on(node.node_id)):
            if node.free >= size:
                return
            if obj.leased(now):
                pinned = True
                continue
            st.evict_replica_locked(obj, node.node_id)
        if node.free < size and pinned:
            raise AllPinned(f"no room for {size} bytes: every candidate for eviction is leased by a reader")

    def tick(self) -> None:
        """Reclaim expired puts, drop silent nodes, finish removals, evict above the high watermark."""
        st = self.state
        tun = st.tunables
        now = time.monotonic()
        with st.lock:
            if not st.role.leader:
                return
            for obj in st.objects.due_puts(now):
                log.info("reclaiming put of %r (no put_end within %.1fs)", obj.key, tun.put_timeout_s)
                st.reclaim_locked(obj)
            for obj in st.objects.ended_removals(now):
                st.delete_locked(obj)
            st.tombstones.expire(now)
            # Leases whose reader never released them (a crashed client) end at their expiry.
            st.release_locked(st.leases.expired(now), now)
            for node in st.nodes.silent(now, tun.node_timeout_s):
                st.drop_node_locked(node.node_id, f"no heartbeat for {now - node.last_heartbeat:.1f}s")
            self.migration.plan_locked()
            for node in st.nodes:
                cap = node.total_capacity
                if cap and node.used > tun.high_watermark * cap:
                    target = node.used - int(tun.low_watermark * cap)
                    for obj in fair_order(o for o in st.objects.on(node.node_id) if not o.removing):
                        if target <= 0:
                            break
                        if obj.leased(now):
                            continue
                        target -= obj.size
                        st.evict_replica_locked(obj, node.node_id)

    def tick_loop(self, stop: threading.Event) -> None:
        period = min(0.5, self.state.settings.pool.heartbeat_s)
        while not stop.wait(period):
            try:
                self.tick()
                self.save_horizon()
            except Exception:  # the loop must survive a bug in one pass
                log.exception("master tick failed")

    def outbox_loop(self) -> None:
        st = self.state
        while True:
            job = st.outbox.get()
            if isinstance(job, Stop):
                return
            if isinstance(job, CloseLink):
                try:
                    job.link.close()
                except Exception:  # closing a dead link
                    log.debug("closing a node link failed", exc_info=True)
            elif isinstance(job, CopyObjects):
                self.migration.run_copy(job)
            elif isinstance(job, RemoveCopies):
                self.remove_copies(job)

    def remove_copies(self, job: RemoveCopies) -> None:
        """Remove the job's copies from its node (outside the lock)."""
        st = self.state
        failed = False
        try:
            link = st.link(job.node_id)
            if link is not None:
                link.remove(job.keys, job.put_ids)
        except Exception as exc:  # a dead node's bytes die with it; a live one re-registers (dirty)
            log.info("removing %d object(s) on node %s failed: %s", len(job.keys), job.node_id, exc)
            failed = True
        with st.lock:
            st.done_locked(job, failed)

    def save_horizon(self) -> None:
        """Cluster mode: tell etcd the tombstones the leader forgot (`RemovalLog.compact`), outside the lock."""
        st = self.state
        with st.lock:
            horizon = st.tombstones.unsaved() if st.role.leader else 0
            log_ = st.removal_log
        if not horizon or log_ is None:
            return
        try:
            log_.compact(horizon)
        except KVPoolError as exc:  # the records stay in etcd meanwhile: a new leader would keep them
            log.info("compacting removes up to %d in etcd failed (retried): %s", horizon, exc)
            return
        with st.lock:
            st.tombstones.mark_saved(horizon)
