"""`EmbeddedPool`: master + one store node in one process on one RPC port (`kvpool serve`).

    pool = EmbeddedPool(load_settings(port=0, dram_capacity="256MiB")).start()
    client = kvpool.connect(pool.address)
    ...
    pool.stop()

A put runs the cluster's protocol (`PutStart`, a write under the granted put id, `PutEnd`), all
answered here in process: over the RPC paths the three ride in one `Put` frame (one round trip),
which `_on_put` answers with the master's `put_start` and `put_end` (what the `PutStart` and
`PutEnd` handlers call) around the node's write of a `NodeWrite`. The engine path's put is
`PutReserve` (PutStart + NodeReserve), the one-sided WRITE, `PutCommit` (NodeCommit + PutEnd):
three round trips, where the cluster takes five. A get is one round trip (or none on the same
host), and the master removes bytes through the node object directly (no socket).
`admin=True` also serves the REST admin API on `settings.pool.admin_port`.
"""

from __future__ import annotations

import logging
from typing import Any

from kvpool.config import Settings, load_settings
from kvpool.errors import InvalidArgument, KVPoolError, Unavailable
from kvpool.master.handlers import master_handlers, master_inline, put_tokens
from kvpool.master.service import MasterService
from kvpool.messages import Err, Placed, Put, PutCommit, PutReserve, Slot, Slots, WriteReply, per_item
from kvpool.node.store_node import StoreNode
from kvpool.node.writes import check_sizes
from kvpool.rpc import Payload, RpcServer, ServerConn

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
        puts = {Put: self._on_put, PutReserve: self._on_put_reserve, PutCommit: self._on_put_commit}
        self.rpc.handlers.update({kind: self.node.while_open(handler) for kind, handler in puts.items()})
        self.rpc.inline.update(master_inline())
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

    def _on_put(self, msg: Put, payload: Payload, conn: ServerConn) -> WriteReply:
        """Each key as the cluster puts it, in one round trip: started at the master (as by
        `PutStart`, under the writer's token), written into the node under the granted put id
        (as by `NodeWrite`), ended at the master (as by `PutEnd`; nothing landed: aborted)."""
        node, keys, sizes = self.node, msg.keys, msg.sizes
        if len(sizes) != len(keys):
            raise InvalidArgument("Put: one size per key")
        check_sizes(sizes, payload, "Put")
        writes = node.writes
        replicas, checked = msg.replicas or None, bool(conn.scope)  # checked: scoped at dispatch
        return WriteReply([self._put_one(writes, key, size, replicas, token, payload, checked)
                           for key, size, token in zip(keys, sizes, put_tokens(keys, msg.token))])

    def _put_one(self, writes: Any, key: str, size: int, replicas: int | None, token: int, payload: Payload,
                 checked: bool) -> Placed | Err:
        master, node_id = self.master, self.node.node_id
        try:
            plan = master.put_start(key, size, replicas, node_id, token)
        except KVPoolError as exc:
            payload.skip(size)
            return Err(exc.code, str(exc))
        if plan.exists:
            payload.skip(size)
            return Placed(node_id, "", "", -1)  # complete already: nothing written
        put_id, landed = plan.put_id, None
        try:
            if len(plan.targets) != 1 or plan.targets[0].node_id != node_id:  # another node registered here
                payload.skip(size)
                raise InvalidArgument(f"put of {key!r} was placed on other nodes; an embedded pool's puts go to "
                                      "its own node")
            landed = writes.write(key, size, put_id, payload, checked)
            master.put_end(key, put_id, [landed])
            return landed
        except KVPoolError as exc:
            if landed is None:
                self._abort(key, put_id)
            return Err(exc.code, str(exc))
        except BaseException:  # the connection broke mid-payload
            self._abort(key, put_id)
            raise

    def _on_put_reserve(self, msg: PutReserve, payload: Payload, conn: ServerConn) -> Slots:
        """The engine path's first round trip: each key started at the master (as by `PutStart`)
        and reserved in the node under the granted put id (as by `NodeReserve`)."""
        node = self.node
        writes = node.writes
        if msg.unpin:
            node.pins.release(msg.unpin, conn)
        if node.transfer_segment is None:
            raise Unavailable(f"node {node.node_id} has no transfer engine; write over the pool RPC")
        master, node_id, replicas = self.master, node.node_id, msg.replicas or None

        def reserve(key: str, size: int, token: int) -> Slot:
            plan = master.put_start(key, size, replicas, node_id, token)
            if plan.exists:
                return Slot(0, -1)
            try:
                if len(plan.targets) != 1 or plan.targets[0].node_id != node_id:
                    raise InvalidArgument(f"put of {key!r} was placed on other nodes; an embedded pool's puts go "
                                          "to its own node")
                return writes.open(key, size, plan.put_id, conn)
            except BaseException:
                self._abort(key, plan.put_id)
                raise

        tokens = put_tokens(msg.keys, msg.token)
        return Slots(per_item(reserve, msg.keys, msg.sizes, tokens), node.transfer_segment)

    def _on_put_commit(self, msg: PutCommit, payload: Payload, conn: ServerConn) -> WriteReply:
        """The engine path's last round trip: each reservation committed (as by `NodeCommit`)
        and its put ended (as by `PutEnd`); a failed or aborted one ends its put with nothing."""
        writes, master = self.node.writes, self.master

        def commit(key: str, put_id: int, ok: bool) -> Placed | Err:
            res = writes.commit(key, put_id, ok, conn)
            if not isinstance(res, Placed):
                self._abort(key, put_id)
                return res
            master.put_end(key, put_id, [res])
            return res

        return WriteReply(per_item(commit, msg.keys, msg.put_ids, msg.ok))

    def _abort(self, key: str, put_id: int) -> None:
        """End a started put with nothing landed (as a `PutEnd` with no replica)."""
        try:
            self.master.put_end(key, put_id, [])
        except KVPoolError:  # "no replica was written": the expected answer
            pass

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
