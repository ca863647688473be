"""`MasterServer`: a standalone master process (`kvpool master`): the service on an RPC port,
plus, in cluster mode (`settings.pool.meta`), leader election and node membership through etcd.

In cluster mode a master starts as a standby. When elected it starts from empty tables and
waits for the nodes registered in etcd to re-report (see `MasterService.become_leader`),
refusing copies an earlier leader's removes cover (`kvpool.cluster.removals`). While
it leads, a node whose etcd key disappears (its lease ended) has its replicas dropped at once.
"""

from __future__ import annotations

import logging
import threading

from kvpool.config import Settings
from kvpool.errors import KVPoolError
from kvpool.master.handlers import master_handlers, master_inline
from kvpool.master.service import MasterService
from kvpool.rpc import RpcServer

log = logging.getLogger(__name__)


class MasterServer:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.rpc = RpcServer({}, settings.pool.host, settings.pool.port, name="master", settings=settings,
                             inline=master_inline())
        self.service = MasterService(settings, address=self.rpc.address)
        self.service.unix_address = self.rpc.unix_address
        self.rpc.handlers.update(master_handlers(self.service))
        self.address = self.rpc.address
        self._etcd = None
        self._election = None
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def start(self) -> "MasterServer":
        self.service.start()
        if self.settings.pool.meta:
            from kvpool.cluster import EtcdClient, LeaderElection, lease_ttl

            from kvpool.cluster.removals import RemovalLog

            self._etcd = EtcdClient(self.settings.pool.meta)
            self.service.state.removal_log = RemovalLog(
                self._etcd, lambda: self._election.lease if self._election is not None else 0)
            self.service.become_standby(None)
            self._election = LeaderElection(self._etcd, self.address, lease_ttl(self.settings.pool.heartbeat_s),
                                            self._on_elected, self.service.become_standby).start()
            self._watcher = threading.Thread(target=self._watch_nodes, name="master-etcd-nodes", daemon=True)
            self._watcher.start()
        self.rpc.start()
        log.info("master serving at %s (%s)", self.address, f"cluster, meta {self.settings.pool.meta}"
                 if self.settings.pool.meta else "standalone")
        return self

    def _registered_nodes(self) -> set[str]:
        from kvpool.cluster import NODES_PREFIX

        return {k[len(NODES_PREFIX):] for k in self._etcd.get_prefix(NODES_PREFIX)}

    def _on_elected(self) -> None:
        try:
            expected = self._registered_nodes()
        except KVPoolError:
            expected = set()
        # Without them a node's re-report could undo an acknowledged remove: if etcd fails here the
        # error ends this term (`LeaderElection` steps down) rather than lead without them.
        log_ = self.service.state.removal_log
        removed, horizon = log_.load()
        floor = log_.reserve(max([horizon, *(g for _, g in removed)]))
        self.service.become_leader(expected, removed, horizon, floor)

    def _watch_nodes(self) -> None:
        while not self._stop.wait(min(0.5, self.settings.pool.heartbeat_s)):
            if not self.service.leader:
                continue
            try:
                alive = self._registered_nodes()
            except KVPoolError as exc:
                log.warning("cannot list nodes in etcd: %s", exc)
                continue
            for node_id in self.service.known_nodes():
                if node_id not in alive:
                    self.service.drop_node(node_id, "its etcd lease ended")

    def stop(self) -> None:
        self._stop.set()
        if self._election is not None:
            self._election.stop()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        self.rpc.stop()
        self.service.stop()
        if self._etcd is not None:
            self._etcd.close()
