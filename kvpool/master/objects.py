"""`ObjectTable`: the master's objects (key -> `ObjectEntry`) and their replicas.

Invariants (every method expects the master's lock held, `kvpool.master.state`):
- An object is `pending` from `plan` until `publish`; only `complete` objects that are not being
  removed are visible to readers (`visible`). A pending object whose deadline passes is
  reclaimed (`due_puts` names it; the state drops it and has its bytes removed).
- A complete object has at least one replica: dropping its last replica drops the object.
- Every replica is accounted on its node (`NodeTable.reserve` / `count` / `add` / `release`):
  replicas change only here, so a node's `used` and `objects` follow them. A node that left has
  no account to give back (`forget_node`).
- Each tenant's use, `usage[tenant] = [bytes of every replica, keys]` (`kvpool.master.quotas`),
  is charged here as entries and replicas come and go; a tenant with no key has no cell.
- The housekeeping tick looks at candidates, not at every object: every pending object is in
  `_pending` and every object being removed in `_removing` (a candidate whose object has moved
  on is dropped when looked at, so nothing that takes an object out of the table has to
  remove it there). Scanning every object twice per tick cost 11 ms of CPU under the lock at
  100,000 objects, every 0.5 s: the tail of every call that waited for the lock.
- `copying`: keys with a drain copy in flight (planned once). It outlives `clear`: a copy
  started in an earlier term still ends (`kvpool.master.migration`), and planning the key
  again meanwhile would put a second copy on a target that might then be removed as an orphan.
"""

from __future__ import annotations

from typing import Iterator, Sequence

from kvpool.master.nodes import NodeTable
from kvpool.master.tables import COMPLETE, PENDING, NodeEntry, ObjectEntry, Replica
from kvpool.messages import Placed
from kvpool.security.tenancy import tenant_of


class ObjectTable:
    def __init__(self, nodes: NodeTable):
        self._nodes = nodes
        self._entries: dict[str, ObjectEntry] = {}
        self.usage: dict[str, list[int]] = {}  # tenant -> [bytes, keys]
        self.get = self._entries.get  # key -> ObjectEntry | None (bound: lookups are hot)
        self._pending: set[str] = set()
        self._removing: set[str] = set()
        self.copying: set[str] = set()  # keys with a drain copy in flight (module doc)

    # -- reading -------------------------------------------------------------------------------
    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def values(self) -> Iterator[ObjectEntry]:
        return iter(self._entries.values())

    def items(self) -> Iterator[tuple[str, ObjectEntry]]:
        return iter(self._entries.items())

    def visible(self, key: str) -> ObjectEntry | None:
        obj = self._entries.get(key)
        return obj if obj is not None and obj.visible() else None

    def on(self, node_id: str) -> Iterator[ObjectEntry]:
        """Complete objects with a replica on `node_id`."""
        return (o for o in self._entries.values() if node_id in o.replicas and o.state == COMPLETE)

    def used(self, tenant: str) -> tuple[int, int]:
        """(bytes, keys) `tenant` holds in the pool (`kvpool.master.quotas`)."""
        cell = self.usage.get(tenant)
        return (cell[0], cell[1]) if cell is not None else (0, 0)

    def _charge(self, key: str, nbytes: int, keys: int = 0) -> None:
        """Add `nbytes` bytes and `keys` keys (either may be negative) to the use of `key`'s tenant."""
        tenant = tenant_of(key)
        cell = self.usage.get(tenant)
        if cell is None:
            cell = self.usage[tenant] = [0, 0]
        cell[0] += nbytes
        cell[1] += keys
        if not cell[1]:
            del self.usage[tenant]

    def candidates(self) -> tuple[frozenset[str], frozenset[str]]:
        """(pending, removing) candidate keys, for checks."""
        return frozenset(self._pending), frozenset(self._removing)

    # -- a put ---------------------------------------------------------------------------------
    def plan(self, key: str, size: int, nodes: Sequence[NodeEntry], put_id: int, deadline: float,
             token: int) -> ObjectEntry:
        """A pending put of `key` on `nodes` (each charged `size` bytes now)."""
        obj = ObjectEntry(key=key, size=size, state=PENDING, replicas={n.node_id: Replica(n.node_id) for n in nodes},
                          put_id=put_id, deadline=deadline, token=token)
        self._entries[key] = obj
        self._charge(key, size * len(obj.replicas), 1)
        self._pending.add(key)
        for n in nodes:
            self._nodes.reserve(n, size)
        return obj

    def publish(self, obj: ObjectEntry, written: Sequence[Placed], now: float) -> tuple[bool, list[str]]:
        """End `obj`'s put with the replicas that landed (`written`, on planned and known nodes).
        Returns (published, nodes whose copy of it must go): copies written where the object was
        not planned (the node left and came back meanwhile: its copy is unknown), then planned
        replicas that did not land (a write still on its way must not land as a copy nobody
        knows). No replica landed: the object leaves the table, unpublished."""
        replicas = obj.replicas
        planned = len(replicas)
        landed = {p.node_id: p for p in written if p.node_id in replicas and p.node_id in self._nodes}
        gone = [p.node_id for p in written if p.node_id not in landed]
        for node_id in list(replicas):
            if node_id not in landed:
                self._nodes.release(node_id, obj.size, counted=False)
                del replicas[node_id]
                gone.append(node_id)
        self._charge(obj.key, obj.size * (len(replicas) - planned), 0 if landed else -1)
        if not landed:
            del self._entries[obj.key]
            return False, gone
        for node_id, p in landed.items():
            replicas[node_id] = Replica(node_id, p.tier, p.segment, p.offset)
            self._nodes.count(node_id)
        obj.state = COMPLETE
        obj.deadline = 0.0
        obj.last_access = now
        return True, gone

    def due_puts(self, now: float) -> list[ObjectEntry]:
        """Pending objects past their deadline (no longer candidates: the caller reclaims them)."""
        due = []
        for key in list(self._pending):
            obj = self._entries.get(key)
            if obj is None or obj.state != PENDING:
                self._pending.discard(key)
            elif obj.deadline <= now:
                self._pending.discard(key)
                due.append(obj)
        return due

    def pending_on(self, node_id: str) -> Iterator[ObjectEntry]:
        for key in self._pending:
            obj = self._entries.get(key)
            if obj is not None and obj.state == PENDING and node_id in obj.replicas:
                yield obj

    # -- a complete object learned from a node -------------------------------------------------
    def adopt(self, key: str, size: int, put_id: int) -> ObjectEntry:
        """A complete object a node reported that the table did not know (no replica yet)."""
        obj = self._entries[key] = ObjectEntry(key=key, size=size, state=COMPLETE, replicas={}, put_id=put_id)
        self._charge(key, 0, 1)
        return obj

    def add_replica(self, obj: ObjectEntry, node: NodeEntry, replica: Replica) -> None:
        """A complete object gained a replica on `node` (not already one of its replicas)."""
        obj.replicas[node.node_id] = replica
        self._nodes.add(node, obj.size)
        self._charge(obj.key, obj.size)

    def retier(self, key: str, node_id: str, tier: str) -> None:
        """The node moved its replica of `key` to another of its tiers (no replica there: ignored)."""
        obj = self._entries.get(key)
        if obj is not None and node_id in obj.replicas:
            obj.replicas[node_id].tier = tier

    # -- removal -------------------------------------------------------------------------------
    def drop(self, obj: ObjectEntry) -> list[str]:
        """The object leaves the table and its replicas' room goes back to their nodes; returns
        the nodes it was on (whose bytes must go)."""
        del self._entries[obj.key]
        self._charge(obj.key, -obj.size * len(obj.replicas), -1)
        counted = obj.state == COMPLETE
        for node_id in obj.replicas:
            self._nodes.release(node_id, obj.size, counted)
        return list(obj.replicas)

    def drop_replica(self, obj: ObjectEntry, node_id: str) -> None:
        """One replica leaves (its room goes back); the last one takes the object along."""
        del obj.replicas[node_id]
        self._nodes.release(node_id, obj.size, obj.state == COMPLETE)
        self._charge(obj.key, -obj.size, 0 if obj.replicas else -1)
        if not obj.replicas:
            del self._entries[obj.key]

    def forget_node(self, node_id: str) -> int:
        """A node left: its replicas leave (no account to give back); returns how many complete
        objects lost their last replica (and left the table)."""
        lost = 0
        for obj in [o for o in self._entries.values() if node_id in o.replicas]:
            del obj.replicas[node_id]
            self._charge(obj.key, -obj.size, 0 if obj.replicas else -1)
            if not obj.replicas:
                del self._entries[obj.key]
                lost += obj.state == COMPLETE
        return lost

    def start_removing(self, obj: ObjectEntry) -> None:
        """Hide a complete object that readers hold leases on; it goes when they end."""
        obj.removing = True
        self._removing.add(obj.key)

    def removing_on(self, node_id: str) -> Iterator[ObjectEntry]:
        for key in self._removing:
            obj = self._entries.get(key)
            if obj is not None and obj.removing and node_id in obj.replicas:
                yield obj

    def ended_removals(self, now: float) -> list[ObjectEntry]:
        """Objects being removed whose leases have all ended (no longer candidates: the caller
        deletes them)."""
        ended = []
        for key in list(self._removing):
            obj = self._entries.get(key)
            if obj is None or not obj.removing:
                self._removing.discard(key)
            elif not obj.leased(now):
                self._removing.discard(key)
                ended.append(obj)
        return ended

    def clear(self) -> None:
        """A new role starts from an empty table (a leader rebuilds it from the nodes' reports)."""
        self._entries.clear()
        self.usage.clear()
        self._pending.clear()
        self._removing.clear()
