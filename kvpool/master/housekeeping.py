"""The master's background work, as a mixin of `MasterService` (it shares the tables and lock).

- `tick()` (every min(0.5 s, heartbeat)): reclaim pending puts past their deadline, finish
  removals whose leases ended, drop nodes silent for `node_timeout_s` (embedded nodes excepted),
  and evict least-recently-used unleased replicas from any node above `high_watermark` of its
  capacity down to `low_watermark`.
- the outbox thread: removes the bytes of dropped objects on their nodes, outside the lock, each
  removal naming the put that wrote the copy.
- drained nodes' objects are copied elsewhere (`kvpool.master.migration`).
- `_make_room_locked`: when no node can take a new object, evict LRU unleased replicas from
  the roomiest node; `AllPinned` when only leased objects stand in the way.
Eviction order is the master's own access recency (it sees every lookup); each node's store
additionally evicts by its own policy (s3fifo/LRU) under local pressure and reports it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvpool.errors import AllPinned
from kvpool.master.tables import COMPLETE, NODE_UP, PENDING, ObjectEntry

log = logging.getLogger("kvpool.master.service")


class Housekeeping:
    def _make_room_locked(self, size: int, now: float) -> None:
        """No node has `size` free: evict LRU unleased objects from the roomiest node."""
        candidates = [n for n in self._nodes.values() if n.state == NODE_UP and n.total_capacity >= size]
        if not candidates:
            return
        node = max(candidates, key=lambda n: n.free)
        pinned = False
        mine = sorted((o for o in self._objects.values() if node.node_id in o.replicas), key=lambda o: o.last_access)
        for obj in mine:
            if node.free >= size:
                return
            if obj.state != COMPLETE:
                continue
            if obj.leased(now):
                pinned = True
                continue
            self._evict_replica_locked(obj, node.node_id)
        if node.free < size and pinned:
            raise AllPinned(f"no room for {size} bytes: every candidate for eviction is leased by a reader")

    def _evict_replica_locked(self, obj: ObjectEntry, node_id: str) -> None:
        del obj.replicas[node_id]
        self._release_space_locked(node_id, obj.size)
        self._outbox.put((node_id, [obj.key], [obj.put_id]))
        self.counters["evictions"] += 1
        if not obj.replicas:
            del self._objects[obj.key]

    def tick(self) -> None:
        """Reclaim expired puts, drop silent nodes, finish removals, evict above the high watermark."""
        now = time.monotonic()
        with self._lock:
            if not self._leader:
                return
            for obj in [o for o in self._objects.values() if o.state == PENDING and o.deadline <= now]:
                log.info("reclaiming put of %r (no put_end within %.1fs)", obj.key, self.put_timeout_s)
                self._reclaim_locked(obj)
            for obj in [o for o in self._objects.values() if o.removing and not o.leased(now)]:
                self._delete_locked(obj)
            # Leases whose reader never released them (a crashed client) end at their expiry.
            self._release_locked([lid for lid, (_, until) in self._lease_keys.items() if until <= now], now)
            for node in [n for n in self._nodes.values()
                         if now - n.last_heartbeat > self.node_timeout_s and n.node_id not in self._local]:
                self._drop_node_locked(node.node_id, f"no heartbeat for {now - node.last_heartbeat:.1f}s")
            self._plan_migrations_locked()
            for node in self._nodes.values():
                cap = node.total_capacity
                if cap and node.used > self.high_watermark * cap:
                    target = node.used - int(self.low_watermark * cap)
                    victims = sorted((o for o in self._objects.values() if node.node_id in o.replicas
                                      and o.state == COMPLETE and not o.removing), key=lambda o: o.last_access)
                    for obj in victims:
                        if target <= 0:
                            break
                        if obj.leased(now):
                            continue
                        target -= obj.size
                        self._evict_replica_locked(obj, node.node_id)

    def _tick_loop(self) -> None:
        period = min(0.5, self.settings.heartbeat_s)
        while not self._stop.wait(period):
            try:
                self.tick()
            except Exception:  # the loop must survive a bug in one pass
                log.exception("master tick failed")

    def _link(self, node_id: str) -> Any:
        with self._lock:
            link = self._links.get(node_id)
            node = self._nodes.get(node_id)
            if link is None and node is not None:
                factory = self._link_factory
                if factory is None:
                    from kvpool.master.links import RemoteNodeLink
                    factory = RemoteNodeLink
                link = self._links[node_id] = factory(node)
            return link

    def _outbox_loop(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None:
                return
            node_id, keys, put_ids = item
            try:
                if node_id == "__close__":
                    keys.close()
                    continue
                if node_id == "__copy__":
                    self._run_copy(keys)
                    continue
                link = self._link(node_id)
                if link is not None:
                    link.remove(keys, put_ids)
            except Exception as exc:  # a dead node's bytes die with it; nothing else to do
                log.info("removing %d object(s) on node %s failed: %s", len(keys), node_id, exc)
