"""How the master reaches a node (to remove bytes of reclaimed, removed or evicted objects)."""

from __future__ import annotations

import threading

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
