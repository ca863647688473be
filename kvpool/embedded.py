"""`EmbeddedPool`: master + one store node in one process on one RPC port (`kvpool serve`).

    pool = EmbeddedPool(load_settings(port=0, dram_capacity="256MiB")).start()
    client = kvpool.connect(pool.address)
    ...
    pool.stop()

The node's handlers consult the in-process master, so a put or a get is one round trip, and the
master removes bytes through the node object directly (no socket). `admin=True` also serves the
REST admin API on `settings.pool.admin_port`.
"""

from __future__ import annotations

import logging
from typing import Any

from kvpool.config import Settings, load_settings
from kvpool.master.handlers import master_handlers
from kvpool.master.service import MasterService
from kvpool.node.store_node import StoreNode
from kvpool.rpc import RpcServer

log = logging.getLogger(__name__)


class EmbeddedPool:
    def __init__(self, settings: Settings | None = None, *, admin: bool = False, transfer_engine: Any = None):
        """`transfer_engine`: a started `transfer.TransferEngine` for the node's arena (caller-owned)."""
        self.settings = settings or load_settings()
        self.transfer_engine = transfer_engine
        self.admin = admin
        self.master: MasterService | None = None
        self.node: StoreNode | None = None
        self.rpc: RpcServer | None = None
        self.admin_handle: Any = None

    @property
    def address(self) -> str:
        return self.rpc.address

    def start(self) -> "EmbeddedPool":
        s = self.settings
        self.rpc = RpcServer({}, s.pool.host, s.pool.port, name="pool", settings=s)
        self.master = MasterService(s, link_factory=lambda entry: self.node, address=self.rpc.address)
        self.master.unix_address = self.rpc.unix_address
        self.node = StoreNode(s, master=self.master, rpc=self.rpc, engine=self.transfer_engine)
        self.rpc.handlers.update(master_handlers(self.master, self.node))
        self.master.start()
        try:
            self.node.start()  # adds its handlers to our server
            self.master.mark_local(self.node.node_id)
            self.rpc.start()
            if self.admin and s.pool.admin_port:
                from kvpool.admin.app import create_app
                from kvpool.admin.server import serve_in_thread

                self.admin_handle = serve_in_thread(create_app(self.master.admin, s), s.pool.host, s.pool.admin_port)
        except BaseException:
            self.stop()
            raise
        log.info("embedded pool serving at %s", self.address)
        return self

    def stop(self) -> None:
        if self.admin_handle is not None:
            self.admin_handle.stop()
        if self.rpc is not None:
            self.rpc.stop()
        if self.node is not None:
            self.node.stop()
        if self.master is not None:
            self.master.stop()

    def __enter__(self) -> "EmbeddedPool":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
