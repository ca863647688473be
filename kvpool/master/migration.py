"""Draining: copy objects off a draining node so it can leave without losing any.

Given the shared `MasterState`. Each housekeeping `tick` plans copies for complete objects whose every replica is
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
from kvpool.master.state import MasterState
from kvpool.master.tables import COMPLETE, NODE_DRAINING, Replica
from kvpool.messages import Placed

log = logging.getLogger("kvpool.master.service")

MIGRATE_BATCH = 64  # objects per copy request


class Migration:
    def __init__(self, state: MasterState):
        self.state = state

    def stranded(self, obj: Any) -> bool:
        return obj.state == COMPLETE and not obj.removing and all(
            self.state.nodes[n].state == NODE_DRAINING for n in obj.replicas if n in self.state.nodes)

    def plan_locked(self) -> None:
        draining = [n for n in self.state.nodes.values() if n.state == NODE_DRAINING]
        if not draining:
            return
        batches: dict[tuple[str, str], list[Any]] = {}
        for obj in self.state.objects.values():
            if len(batches) > 8 or obj.key in self.state.migrating or not obj.replicas or not self.stranded(obj):
                continue
            source = next(iter(obj.replicas))
            targets = [n for n in choose_nodes(list(self.state.nodes.values()), obj.size, len(self.state.nodes))
                       if n.node_id not in obj.replicas]
            if not targets:
                continue
            batch = batches.setdefault((source, targets[0].node_id), [])
            if len(batch) < MIGRATE_BATCH:
                batch.append(obj)
                self.state.migrating.add(obj.key)
        for (source, target), objs in batches.items():
            self.state.queue_copy_locked(target, (source, self.state.nodes[source].address, target,
                                                  [o.key for o in objs], [o.put_id for o in objs]))

    def run_copy(self, job: tuple, term: int) -> None:
        source, source_address, target, keys, put_ids = job
        failed = False
        try:
            link = self.state.link(target)
            results = link.copy(keys, put_ids, source_address) if link is not None else []
        except Exception as exc:  # the target or source died: the next tick plans again
            log.info("copy of %d object(s) %s -> %s failed: %s", len(keys), source, target, exc)
            results, failed = [], True
        orphans: list[tuple[str, int]] = []
        with self.state.lock:
            if failed:  # some may have landed all the same: none may linger unknown
                orphans = list(zip(keys, put_ids))
            for i, key in enumerate(keys):
                self.state.migrating.discard(key)
                placed = results[i] if i < len(results) else None
                if not isinstance(placed, Placed):
                    continue
                obj = self.state.objects.get(key)
                node = self.state.nodes.get(target)
                if obj is None or node is None or obj.put_id != put_ids[i] or obj.state != COMPLETE \
                        or target in obj.replicas:
                    orphans.append((key, put_ids[i]))
                    continue
                obj.replicas[target] = Replica(target, placed.tier, placed.segment, placed.offset)
                node.used += obj.size
                node.objects += 1
            if orphans:
                self.state.queue_removal_locked(target, [k for k, _ in orphans], [p for _, p in orphans])
            self.state.done_locked(target, term)
        if results:
            log.info("drained %d object(s) from %s to %s", sum(isinstance(r, Placed) for r in results), source, target)
