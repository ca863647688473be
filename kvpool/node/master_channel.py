"""How a node reaches its master: in process (embedded) or over RPC, found through etcd in
cluster mode. `changed` turns True when the node must register again (a new leader, or the
master forgot it), so the node re-reports everything it holds and a failover loses nothing."""

from __future__ import annotations

import json
import logging
from typing import Any

from kvpool.config import Settings
from kvpool.errors import KVPoolError, NotLeader, Unavailable
from kvpool.messages import Held, Heartbeat, NodeInfo, RegisterNode
from kvpool.rpc import RpcClient, parse_address
from kvpool.rpc.client import node_credential

log = logging.getLogger(__name__)


class MasterChannel:
    """`master`: the `MasterService` in this process (embedded), else None and `settings` say
    where the master is (`master` address, or `meta` etcd to find the leader)."""

    def __init__(self, master: Any = None, settings: Settings | None = None):
        self._master = master
        self._settings = settings
        self._rpc: RpcClient | None = None
        self._etcd = None
        self._registration = None
        self._credential = node_credential(settings) if settings is not None else None
        self.changed = False
        if settings is not None and settings.pool.meta:
            from kvpool.cluster import EtcdClient

            self._etcd = EtcdClient(settings.pool.meta)
        elif settings is not None:
            parse_address(settings.pool.master)  # a typo fails at start, not in every heartbeat

    def _leader_address(self) -> str:
        if self._etcd is None:
            return self._settings.pool.master
        from kvpool.cluster.membership import leader_address

        return leader_address(self._etcd)

    def _client(self) -> RpcClient:
        if self._etcd is not None and self._rpc is not None:
            leader = self._leader_address()
            if leader != self._rpc.address:  # a new leader: re-register there
                log.info("master leader moved %s -> %s", self._rpc.address, leader)
                self._rpc.close()
                self._rpc = None
                self.changed = True
        if self._rpc is None:
            self._rpc = RpcClient(self._leader_address(), timeout=5.0, credential=self._credential)
        return self._rpc

    def _call(self, msg: Any) -> Any:
        try:
            return self._client().call(msg)
        except (Unavailable, NotLeader):
            if self._rpc is not None:
                self._rpc.close()
                self._rpc = None
            self.changed = True
            raise

    def register(self, info: NodeInfo, objects: list[Held], mark: int = 0) -> None:
        if self._master is not None:
            self._master.register_node(info, objects, mark)
            return
        if self._etcd is not None and self._registration is None:
            from kvpool.cluster import NODES_PREFIX, Registration, lease_ttl

            doc = json.dumps({"node_id": info.node_id, "address": info.address})
            self._registration = Registration(self._etcd, NODES_PREFIX + info.node_id, doc,
                                              lease_ttl(self._settings.pool.heartbeat_s)).start()
        self._call(RegisterNode(info, objects, mark))
        self.changed = False

    def heartbeat(self, node_id: str, stats: dict, dropped: list[Held], moved: list[Held]) -> tuple[bool, int]:
        """(known, mark): see `HeartbeatReply`."""
        if self._master is not None:
            return self._master.heartbeat(node_id, stats, dropped, moved)
        if self._rpc is None:
            self.changed = True
            self._client()
            return False, 0
        reply = self._call(Heartbeat(node_id, _jsonable(stats), dropped, moved))
        return reply.known, reply.mark

    def node_addresses(self) -> set[str] | None:
        """The RPC addresses of the registered nodes (the embedded master's table, or etcd's
        registrations); None when this channel cannot know (a static master address)."""
        if self._master is not None:
            return self._master.node_addresses()
        if self._etcd is None:
            return None
        from kvpool.cluster import NODES_PREFIX

        out = set()
        for raw in self._etcd.get_prefix(NODES_PREFIX).values():
            try:
                out.add(json.loads(raw)["address"])
            except (ValueError, KeyError, TypeError):
                continue
        return out

    def close(self) -> None:
        if self._registration is not None:
            try:
                self._registration.stop()
            except KVPoolError:
                pass
        if self._rpc is not None:
            self._rpc.close()
        if self._etcd is not None:
            self._etcd.close()


def _jsonable(doc: dict) -> dict:
    """Stats go on the wire as msgpack: keep plain types only."""
    return json.loads(json.dumps(doc, default=str))
