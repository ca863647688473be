"""Draining: copy objects off a draining node so it can leave without losing any.

A mixin of `MasterService`. Each `tick` plans copies for complete objects whose every replica is
on a draining node: a target node (up, with room, not already holding it) is told to pull the
bytes from the source node itself (`NodeCopy`), so the master stays off the data path. When the
copy lands and the object is still the same put, the new replica is added; otherwise the copy is
removed again. An object being copied is marked so it is planned once; a failed copy is retried
on a later tick.
"""

from __future__ import annotations

import logging
from typing import Any

from kvpool.master.placement import choose_nodes
from kvpool.master.tables import COMPLETE, NODE_DRAINING, Replica
from kvpool.messages import Placed

log = logging.getLogger("kvpool.master.service")

MIGRATE_BATCH = 64  # objects per copy request


class Migration:
    def pending_migration(self, node_id: str) -> int:
        """Objects that still have no replica outside draining nodes, among those on `node_id`."""
        with self._lock:
            return sum(1 for o in self._objects.values() if node_id in o.replicas and self._stranded(o))

    def _stranded(self, obj: Any) -> bool:
        return obj.state == COMPLETE and not obj.removing and all(
            self._nodes[n].state == NODE_DRAINING for n in obj.replicas if n in self._nodes)

    def _plan_migrations_locked(self) -> None:
        draining = [n for n in self._nodes.values() if n.state == NODE_DRAINING]
        if not draining:
            return
        batches: dict[tuple[str, str], list[Any]] = {}
        for obj in self._objects.values():
            if len(batches) > 8 or obj.key in self._migrating or not obj.replicas or not self._stranded(obj):
                continue
            source = next(iter(obj.replicas))
            targets = [n for n in choose_nodes(list(self._nodes.values()), obj.size, len(self._nodes))
                       if n.node_id not in obj.replicas]
            if not targets:
                continue
            batch = batches.setdefault((source, targets[0].node_id), [])
            if len(batch) < MIGRATE_BATCH:
                batch.append(obj)
                self._migrating.add(obj.key)
        for (source, target), objs in batches.items():
            self._outbox.put(("__copy__", (source, self._nodes[source].address, target,
                                           [o.key for o in objs], [o.put_id for o in objs]), None))

    def _run_copy(self, job: tuple) -> None:
        source, source_address, target, keys, put_ids = job
        try:
            link = self._link(target)
            results = link.copy(keys, put_ids, source_address) if link is not None else []
        except Exception as exc:  # the target or source died: the next tick plans again
            log.info("copy of %d object(s) %s -> %s failed: %s", len(keys), source, target, exc)
            results = []
        orphans: list[tuple[str, int]] = []
        with self._lock:
            for i, key in enumerate(keys):
                self._migrating.discard(key)
                placed = results[i] if i < len(results) else None
                if not isinstance(placed, Placed):
                    continue
                obj = self._objects.get(key)
                node = self._nodes.get(target)
                if obj is None or node is None or obj.put_id != put_ids[i] or obj.state != COMPLETE \
                        or target in obj.replicas:
                    orphans.append((key, put_ids[i]))
                    continue
                obj.replicas[target] = Replica(target, placed.tier, placed.segment, placed.offset)
                node.used += obj.size
                node.objects += 1
        for key, put_id in orphans:
            self._outbox.put((target, [key], [put_id]))
        if results:
            log.info("drained %d object(s) from %s to %s", sum(isinstance(r, Placed) for r in results), source, target)
