"""`NodeTable`: the store nodes the master knows, and its account of the room on each.

Invariants (every method expects the master's lock held, `kvpool.master.state`):
- A node is in the table from its registration until it is dropped (heartbeats or etcd lease
  ended, removed by an operator); an id an operator removed (`banned`) never registers again.
- A live node is never re-pointed to another address: a registration from elsewhere is refused
  until the known one has been silent for the node timeout (an impostor would take its reads
  and writes), unless the node runs in this process (`local`: embedded, never timed out).
- `NodeEntry.used` / `objects` change only through `reserve`, `count`, `add` and `release`, and
  never go below 0; the object table calls them as replicas come and go
  (`kvpool.master.objects`), so `used` is the bytes of the replicas placed on the node, pending
  ones included, and `objects` its complete replicas.
- `dirty` (nodes a removal failed to reach: no mark until they register again) holds only
  nodes in the table.
"""

from __future__ import annotations

from typing import Iterator

from kvpool.errors import AlreadyExists, InvalidArgument, KeyNotFound, Unavailable
from kvpool.master.tables import NodeEntry
from kvpool.messages import NodeInfo

MAX_OBJECT_BYTES = 1 << 32  # protocol-level ceiling; a node's DRAM capacity is usually lower


class NodeTable:
    def __init__(self) -> None:
        self._nodes: dict[str, NodeEntry] = {}
        self.get = self._nodes.get  # node id -> NodeEntry | None (bound: lookups are hot)
        self.banned: set[str] = set()  # node ids an operator removed
        self.local: set[str] = set()  # nodes in this process (embedded)
        self._dirty: set[str] = set()

    # -- reading -------------------------------------------------------------------------------
    def __contains__(self, node_id: str) -> bool:
        return node_id in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    def __iter__(self) -> Iterator[NodeEntry]:
        return iter(self._nodes.values())

    def values(self) -> list[NodeEntry]:
        return list(self._nodes.values())

    def ids(self) -> list[str]:
        return list(self._nodes)

    def require(self, node_id: str) -> NodeEntry:
        node = self._nodes.get(node_id)
        if node is None:
            raise KeyNotFound(f"node {node_id!r} not found")
        return node

    def addresses(self) -> set[str]:
        return {n.address for n in self._nodes.values()}

    def max_object(self) -> int:
        """The largest object a node can hold (`Unavailable` with no node)."""
        nodes = self._nodes
        if not nodes:
            raise Unavailable("no store node is registered with the master")
        if len(nodes) == 1:  # the embedded pool: every put asks
            for n in nodes.values():
                return min(MAX_OBJECT_BYTES, n.capacity.get("dram", 0) or sum(n.capacity.values()))
        dram = max((n.capacity.get("dram", 0) for n in nodes.values()), default=0)
        return min(MAX_OBJECT_BYTES, dram or max(n.total_capacity for n in nodes.values()))

    def silent(self, now: float, timeout_s: float) -> list[NodeEntry]:
        """Nodes (not in this process) without a heartbeat for more than `timeout_s`."""
        return [n for n in self._nodes.values()
                if now - n.last_heartbeat > timeout_s and n.node_id not in self.local]

    # -- membership ----------------------------------------------------------------------------
    def join(self, info: NodeInfo, now: float, timeout_s: float) -> tuple[NodeEntry, bool]:
        """(Re-)register a node from its `info`; returns it and whether it moved to another
        address (its old connection is useless). Refuses a banned id and the re-pointing of a
        live node (module doc); a node that joins is no longer dirty."""
        if info.node_id in self.banned:
            raise InvalidArgument(f"node {info.node_id!r} was removed by an operator; start it with another id")
        node = self._nodes.get(info.node_id)
        moved = False
        if node is None:
            node = self._nodes[info.node_id] = NodeEntry(node_id=info.node_id, address=info.address)
        elif node.address != info.address:  # restarted elsewhere
            silent = now - node.last_heartbeat
            if node.node_id not in self.local and silent <= timeout_s:
                raise AlreadyExists(f"node {info.node_id!r} is live at {node.address} (heartbeat {silent:.1f}s "
                                    f"ago); it can re-register at {info.address} after {timeout_s}s "
                                    "without heartbeats")
            moved = True
        node.address, node.hostname, node.segments = info.address, info.hostname, list(info.segments)
        node.shm_path, node.capacity = info.shm_path, dict(info.capacity)
        node.transfer_segment = info.transfer_segment
        node.last_heartbeat = now
        self._dirty.discard(node.node_id)
        return node, moved

    def heard(self, node_id: str, now: float, stats: dict | None) -> NodeEntry | None:
        """A heartbeat (with the node's own stats, if any); None: unknown node."""
        node = self._nodes.get(node_id)
        if node is not None:
            node.last_heartbeat = now
            if stats:
                node.stats = dict(stats)
        return node

    def set_state(self, node_id: str, state: str) -> NodeEntry:
        """`NODE_UP` or `NODE_DRAINING` (no new replicas: `kvpool.master.placement`)."""
        node = self.require(node_id)
        node.state = state
        return node

    def drop(self, node_id: str) -> NodeEntry | None:
        self._dirty.discard(node_id)
        return self._nodes.pop(node_id, None)

    def clear(self) -> None:
        """A new role: no node is known (operator bans and in-process nodes stay)."""
        self._nodes.clear()
        self._dirty.clear()

    def all_local(self) -> bool:
        """Is every node in this process (or none known)? Then no node ever re-reports."""
        local = self.local
        return bool(local) and all(n in local for n in self._nodes)

    # -- removals that failed ------------------------------------------------------------------
    def mark_dirty(self, node_id: str) -> None:
        if node_id in self._nodes:
            self._dirty.add(node_id)

    def is_dirty(self, node_id: str) -> bool:
        return node_id in self._dirty

    # -- the account (called by the object table) ----------------------------------------------
    @staticmethod
    def reserve(node: NodeEntry, size: int) -> None:
        """A pending replica of `size` bytes was planned on `node`."""
        node.used += size

    def count(self, node_id: str) -> None:
        """A planned replica on the node landed: the object is complete."""
        self._nodes[node_id].objects += 1

    @staticmethod
    def add(node: NodeEntry, size: int) -> None:
        """A complete replica of `size` bytes is on `node` (a node's report, a drain copy)."""
        node.used += size
        node.objects += 1

    def release(self, node_id: str, size: int, counted: bool) -> None:
        """A replica left the node (`counted`: a complete one); unknown nodes are ignored."""
        node = self._nodes.get(node_id)
        if node is not None:
            node.used = max(0, node.used - size)
            if counted:
                node.objects = max(0, node.objects - 1)
