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

from kvpool.master.outbox import CopyObjects
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
        node_of = self.state.nodes.get
        return obj.state == COMPLETE and not obj.removing and all(
            n.state == NODE_DRAINING for n in map(node_of, obj.replicas) if n is not None)

    def plan_locked(self) -> None:
        st = self.state
        nodes = st.nodes
        if not any(n.state == NODE_DRAINING for n in nodes):
            return
        batches: dict[tuple[str, str], list[Any]] = {}
        copying = st.objects.copying
        for obj in st.objects.values():
            if len(batches) > 8 or obj.key in copying or not obj.replicas or not self.stranded(obj):
                continue
            source = next(iter(obj.replicas))
            targets = [n for n in choose_nodes(nodes.values(), obj.size, len(nodes))
                       if n.node_id not in obj.replicas]
            if not targets:
                continue
            batch = batches.setdefault((source, targets[0].node_id), [])
            if len(batch) < MIGRATE_BATCH:
                batch.append(obj)
                copying.add(obj.key)
        for (source, target), objs in batches.items():
            st.outbox.copy(source, nodes.require(source).address, target, [o.key for o in objs],
                           [o.put_id for o in objs])

    def run_copy(self, job: CopyObjects) -> None:
        """Have the target pull the job's objects (outside the lock); add the copies that landed
        as replicas, and remove those that no longer belong."""
        st = self.state
        source, target, keys, put_ids = job.source, job.target, job.keys, job.put_ids
        failed = False
        try:
            link = st.link(target)
            results = link.copy(keys, put_ids, job.source_address) if link is not None else []
        except Exception as exc:  # the target or source died: the next tick plans again
            log.info("copy of %d object(s) %s -> %s failed: %s", len(keys), source, target, exc)
            results, failed = [], True
        orphans: list[tuple[str, int]] = []
        with st.lock:
            if failed:  # some may have landed all the same: none may linger unknown
                orphans = list(zip(keys, put_ids))
            for i, key in enumerate(keys):
                st.objects.copying.discard(key)
                placed = results[i] if i < len(results) else None
                if not isinstance(placed, Placed):
                    continue
                obj = st.objects.get(key)
                node = st.nodes.get(target)
                if obj is None or node is None or obj.put_id != put_ids[i] or obj.state != COMPLETE \
                        or target in obj.replicas:
                    orphans.append((key, put_ids[i]))
                    continue
                st.objects.add_replica(obj, node, Replica(target, placed.tier, placed.segment, placed.offset))
            if orphans:
                st.outbox.remove(target, [k for k, _ in orphans], [p for _, p in orphans])
            st.done_locked(job)
        if results:
            log.info("drained %d object(s) from %s to %s", sum(isinstance(r, Placed) for r in results), source, target)
