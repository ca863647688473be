"""How the master reaches a node (to remove bytes of reclaimed, removed or evicted objects, and to
have it copy objects off a draining node)."""

from __future__ import annotations

import threading
from typing import Any, Callable

from kvpool.security.keyring import Credential
from kvpool.master.tables import NodeEntry
from kvpool.messages import NodeCopy, NodeRemove
from kvpool.rpc import RpcClient


class RemoteNodeLink:
    """A persistent RPC connection to one node; used from the master's outbox thread."""

    def __init__(self, node: NodeEntry, timeout: float = 5.0, credential: Credential | None = None):
        """`credential`: the keyring's node principal when authentication is on."""
        self.node_id = node.node_id
        self._rpc = RpcClient(node.address, timeout=timeout, credential=credential)
        self._lock = threading.Lock()

    def remove(self, keys: list[str], put_ids: list[int]) -> list[bool]:
        with self._lock:
            return self._rpc.call(NodeRemove(list(keys), list(put_ids))).values

    def copy(self, keys: list[str], put_ids: list[int], source: str) -> list:
        with self._lock:
            return self._rpc.call(NodeCopy(list(keys), list(put_ids), source)).results

    def close(self) -> None:
        with self._lock:
            self._rpc.close()


class Links:
    """One link per node, made on first use by `factory(node)` (default: a `RemoteNodeLink` with the
    node credential of `settings`; the embedded pool passes one that returns its node). The caller
    holds the master's lock. A node that leaves or moves has its link taken (`pop`) and closed by
    the outbox, so no link outlives its node's address."""

    def __init__(self, factory: Callable[[NodeEntry], Any] | None, settings: Any):
        self._links: dict[str, Any] = {}
        self._factory = factory
        self._settings = settings

    def get(self, node_id: str, node: NodeEntry | None) -> Any:
        """The node's link (made now if `node` is given and it has none); None: no such node."""
        link = self._links.get(node_id)
        if link is None and node is not None:
            factory = self._factory
            if factory is None:
                from kvpool.rpc.client import node_credential
                cred = node_credential(self._settings)
                factory = lambda entry: RemoteNodeLink(entry, credential=cred)  # noqa: E731
            link = self._links[node_id] = factory(node)
        return link

    def pop(self, node_id: str) -> Any:
        return self._links.pop(node_id, None)

    def take_all(self) -> list[Any]:
        links, self._links = list(self._links.values()), {}
        return links
