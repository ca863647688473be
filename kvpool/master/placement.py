"""Placement: which nodes get the replicas of a new object.

Local-first: when the writer is itself a node (and may take new objects), it gets the first
replica, so the write is a same-host copy. The rest go to the nodes with the most free space
(the master's own account), which spreads load and keeps the fullest nodes from evicting.
Draining nodes never get new replicas.
"""

from __future__ import annotations

from kvpool.master.tables import NODE_UP, NodeEntry


def choose_nodes(nodes: list[NodeEntry], size: int, count: int, writer_node: str = "") -> list[NodeEntry]:
    """Up to `count` distinct nodes with room for `size` bytes, best first (may be fewer)."""
    if len(nodes) == 1:  # the embedded pool: no sorting or filtering lists
        n = nodes[0]
        return [n] if count > 0 and n.state == NODE_UP and n.free >= size else []
    fits = [n for n in nodes if n.state == NODE_UP and n.free >= size]
    fits.sort(key=lambda n: n.free, reverse=True)
    if writer_node:
        local = [n for n in fits if n.node_id == writer_node]
        fits = local + [n for n in fits if n.node_id != writer_node]
    return fits[:count]
