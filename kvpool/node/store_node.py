"""`StoreNode`: one node of the pool. Owns a `TieredStore`, serves reads and writes, heartbeats.

Data path (all on the node's RPC port, one round trip each):
- `NodeGet`: pin each object (promoting it from SSD if needed), send its bytes straight from the
  arena with `sendmsg`, unpin. A pinned object is never evicted mid-send.
- `NodePin` / `NodeUnpin`: a same-host or transfer-engine reader pins, copies out of the arena,
  and unpins with its next request or a one-way `NodeUnpin` (`kvpool.node.pins`), which also
  reports the reads same-host readers served from the shm DRAM index (hits, eviction recency).
- `NodeWrite`, `NodeCopy`, `NodeReserve` / `NodeCommit`: writes (`kvpool.node.writes`).
- `NodeRemove`: removes a copy only if it is still the named put's.
- Its read port (`[node] read_workers` > 0): `NodeGet` served by the node and by worker processes
  reading the shm arena and index, so TCP gets use more than this process's one core
  (`kvpool.node.readers`).

Objects the store evicts by its own policy are reported to the master with the next heartbeat
(embedded: at once). The master's mark (`HeartbeatReply.mark`, `kvpool.master.state`) goes to
`Writes` and, with an SSD tier, to `MARK_FILE` beside it, so that copies which survive a restart
are reported with the mark they had. The arena is also registered with the transfer engine (when available;
`engine=` passes one in, e.g. with an RDMA device), and its descriptor is published in
`NodeInfo.transfer_segment` (and `NodeStats`) for peers that move bytes with `transfer`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

import msgspec

from kvpool.config import Settings
from kvpool.errors import Forbidden, InvalidArgument, KVPoolError, Unavailable
from kvpool.messages import (Bools, Held, Info, NodeCommit, NodeCopy, NodeData, NodeGet, NodeInfo, NodePin, NodeRemove,
                             NodeReserve, NodeStats, NodeUnpin, NodeWrite, Pins, Slots, WriteReply, per_item)
from kvpool.node import grants
from kvpool.node.master_channel import MasterChannel
from kvpool.node.pins import Pins as PinTable
from kvpool.node.readers import ReadWorkers, worker_count
from kvpool.node.writes import Writes, check_sizes
from kvpool.rpc import Payload, RpcServer, ServerConn
from kvpool.rpc.client import node_credential
from kvpool.security.keyring import ticket_key
from kvpool.security.tickets import Tickets
from transfer.route import local_host_id

log = logging.getLogger("kvpool.node")

INLINE_MAX = 32 * 1024  # NodePin sends objects up to this size in the reply instead of pinning them
MARK_FILE = "kvpool-mark"  # in the SSD tier's directory: the mark its copies were last covered by
MARK_SAVE_S = 2.0  # at most one write of it per this many seconds (an older mark claims less: safe)


class StoreNode:
    """A store node. `master`: a `MasterService` in this process (embedded mode), else None.
    `rpc`: a server to add the node's handlers to (the embedded pool shares one with the
    master; the caller starts and stops it), else the node serves on its own.
    `engine`: a started `transfer.TransferEngine` to register the arena with (the caller owns
    it); default: the node starts its own with `settings.node.transports`."""

    def __init__(self, settings: Settings, *, master: Any = None, rpc: RpcServer | None = None, engine: Any = None):
        self.settings = settings
        self.master = master
        self.store: Any = None  # the TieredStore, from start to stop
        self.rpc = rpc
        self._own_rpc = rpc is None
        self.node_id = settings.node.node_id or ""
        self.segment = ""
        self.pins: PinTable | None = None
        self.writes: Writes | None = None
        self._news_lock = threading.Lock()
        self._dropped: list[Held] = []  # store events for the next heartbeat
        self._moved: list[Held] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.channel: MasterChannel | None = None
        self.engine = engine
        self._own_engine = engine is None
        self.transfer_segment: bytes | None = None
        self.readers: ReadWorkers | None = None
        self._mark_saved_at = 0.0
        self._mark_unsaved = False  # a newer mark than MARK_FILE's waits out the save interval

    # ------------------------------------------------------------------ lifecycle

    def handlers(self) -> dict[type, Any]:
        table = {NodeGet: self._on_get, NodePin: self._on_pin, NodeUnpin: self._on_unpin, NodeWrite: self._on_write,
                 NodeRemove: self._on_remove, NodeCopy: self._on_copy, NodeStats: self._on_stats,
                 NodeReserve: self._on_reserve, NodeCommit: self._on_commit}
        return {kind: self.while_open(handler) for kind, handler in table.items()}

    def inline(self) -> dict[type, Any]:
        """The requests the RPC server may answer on its loop thread (`kvpool.rpc.loop`): those
        that only touch memory. A get or pin of objects all in DRAM (not one to read from SSD
        first), and an unpin, unless releasing revokes grants (which waits for READs in flight)."""
        def reads(msg: Any, scope: str) -> bool:
            store, pins = self.store, self.pins
            return (store is not None and pins is not None and not (msg.unpin and pins.granted(msg.unpin))
                    and store.resident(msg.keys, scope))

        def unpins(msg: NodeUnpin, scope: str) -> bool:
            pins = self.pins
            return pins is not None and not pins.granted(msg.pin_ids)

        return {NodeGet: reads, NodePin: reads, NodeUnpin: unpins}

    def while_open(self, handler: Any) -> Any:
        """A request still in flight when `stop` closed the store gets `Unavailable`, not a crash."""
        def guarded(msg: Any, payload: Payload, conn: ServerConn) -> Any:
            if self.store is None:
                raise Unavailable(f"node {self.node_id} is stopping")
            return handler(msg, payload, conn)

        return guarded

    def start(self) -> "StoreNode":
        try:
            return self._start()
        except BaseException:
            self.stop()  # never leave an arena file or a listening socket behind
            raise

    def _start(self) -> "StoreNode":
        s = self.settings
        from kvpool.tiers import TieredStore

        self.store = TieredStore.from_settings(s)
        if self.master is not None:  # it enforces tenant quotas pool-wide on every write we take (master/quotas.py)
            self.store.quotas = {}
        self.store.on_event = self._on_store_event
        if self._own_rpc:
            self.rpc = RpcServer(self.handlers(), s.pool.host, s.pool.port, name="node", on_close=self.conn_closed,
                                 settings=s, inline=self.inline()).start()
        else:
            self.rpc.handlers.update(self.handlers())
            self.rpc.inline.update(self.inline())
            self.rpc.on_close = self.conn_closed
        self.node_id = self.node_id or f"{socket.gethostname()}:{self.rpc.port}"
        self.segment = f"{self.node_id}/dram"
        master = self.master
        self.pins = PinTable(self.store, s.pool.lease_s, master.touch if master is not None else None)
        self.writes = Writes(self.store, self.node_id, self.segment, s.pool.put_timeout_s, master)
        self.writes.credential = node_credential(s)  # what it shows the source node of a copy
        keyring = getattr(self.rpc, "keyring", None)
        # Our master is elsewhere: its tickets admit each write. Not with the user's own keyring
        # (`kvpool.security.local`): its one principal could sign tickets itself, as with grants.
        if keyring is not None and not keyring.local and master is None:
            self.writes.tickets = Tickets(ticket_key(keyring.node_credential().secret))
        self._load_mark()
        self._start_readers()
        self._start_transfer_engine()
        self.channel = MasterChannel(master, None if master is not None else s)
        self._register()
        self._thread = threading.Thread(target=self._heartbeat_loop, name="node-heartbeat", daemon=True)
        self._thread.start()
        log.info("node %s serving at %s (DRAM %d bytes, shm %s)", self.node_id, self.rpc.address,
                 self.store.arena.size, self.store.arena.path)
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.readers is not None:
            self.readers.stop()
            self.readers = None
        if self.rpc is not None and self._own_rpc:
            self.rpc.stop()
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.engine is not None:
            try:
                if not self._own_engine:
                    if self.transfer_segment is not None:
                        self.engine.unregister(self.segment)
                else:
                    self.engine.close()
            except Exception:
                log.debug("closing the transfer engine failed", exc_info=True)
            self.engine = None
        if self.pins is not None:
            self.pins.close()
        if self.store is not None:
            self.store.close()
            self.store = None

    def _start_readers(self) -> None:
        """The read port and its workers, when configured and the arena has a shm index to read."""
        from kvpool.shm import index as shm_index

        count, index_path = worker_count(self.settings.node.read_workers), self._index_path()
        if count and index_path is not None and shm_index.supported():
            self.readers = ReadWorkers(self, count, index_path).start()

    def _start_transfer_engine(self) -> None:
        """Expose the arena to `transfer` peers; the pool works without it (our RPC carries bytes)."""
        try:
            from transfer import TransferEngine

            if self.engine is None:
                transports = [t for t in self.settings.node.transports if t in ("shm", "tcp", "rdma")]
                self.engine = TransferEngine(name=f"kvpool-{self.node_id}", host=self.settings.pool.host,
                                             transports=transports or ("tcp",), limits=self.settings.rpc.limits(),
                                             rdma_device=self.settings.rpc.rdma_device,
                                             rdma_gid_index=self.settings.rpc.rdma_gid_index,
                                             **grants.engine_access(getattr(self.rpc, "keyring", None))).start()
            desc = self.engine.register(self.store.arena.buffer, name=self.segment, shm_path=self.store.arena.path)
            self.transfer_segment = desc.to_bytes()
            grants.attach(self.engine, self.segment, self.pins, self.writes, getattr(self.rpc, "keyring", None),
                          self.node_id)
        except Exception as exc:  # an optional path: log and carry on
            log.warning("node %s: transfer engine unavailable (%s); serving over the pool RPC only",
                        self.node_id, exc)
            if self._own_engine:
                self.engine = None

    def info(self) -> NodeInfo:
        s = self.settings.node
        capacity = {"dram": self.store.arena.size}
        if s.ssd_path:
            capacity["ssd"] = s.ssd_capacity
        readers = self.readers
        return NodeInfo(node_id=self.node_id, address=self.rpc.address, hostname=socket.gethostname(),
                        segments=[self.segment], shm_path=self.store.arena.path, capacity=capacity,
                        transfer_segment=self.transfer_segment, index_path=self._index_path(),
                        unix=self.rpc.unix_address, host_id=local_host_id(),
                        read_address=readers.address if readers is not None else None)

    def _index_path(self) -> str | None:
        index = getattr(getattr(self.store, "dram", None), "index", None)
        return None if index is None else index.path

    def held(self) -> list[Held]:
        return [Held(k, size, tier, self.writes.put_id_of(k)) for k, size, tier in self.store.keys()]

    def _mark_path(self) -> str | None:
        return os.path.join(self.settings.node.ssd_path, MARK_FILE) if self.settings.node.ssd_path else None

    def _load_mark(self) -> None:
        path = self._mark_path()
        try:
            if path is not None:
                self.writes.set_mark(int(open(path).read().strip() or 0))
        except (OSError, ValueError):  # none yet, or torn: no mark (it only makes the master trust less)
            pass

    def _save_mark(self) -> None:
        path = self._mark_path()
        now = time.monotonic()
        if path is None:
            return
        if now - self._mark_saved_at < MARK_SAVE_S:
            self._mark_unsaved = True  # saved by a later heartbeat, not lost
            return
        self._mark_saved_at = now
        self._mark_unsaved = False
        try:
            with open(path + ".tmp", "w") as f:
                f.write(str(self.writes.mark))
            os.replace(path + ".tmp", path)
        except OSError as exc:  # a full disk: the older mark stays, which is safe
            log.info("node %s: saving the mark failed: %s", self.node_id, exc)

    def _register(self) -> None:
        try:
            self.channel.register(self.info(), self.held(), self.writes.mark)
        except KVPoolError as exc:
            log.warning("node %s: registration failed (%s); retrying with the next heartbeat", self.node_id, exc)

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.settings.pool.heartbeat_s):
            expired = self.pins.expire()
            if expired:
                log.info("node %s: %d pin(s) expired without an unpin", self.node_id, expired)
            self.writes.expire()
            with self._news_lock:
                dropped, self._dropped = self._dropped, []
                moved, self._moved = self._moved, []
            try:
                stats = self.store.stats()
                known, mark = self.channel.heartbeat(self.node_id, stats, dropped, moved)
                if (mark and self.writes.set_mark(mark)) or self._mark_unsaved:
                    self._save_mark()
                if not known or self.channel.changed:
                    self.channel.changed = False
                    self.channel.register(self.info(), self.held(), self.writes.mark)
            except KVPoolError as exc:
                log.info("node %s: heartbeat failed (%s)", self.node_id, exc)
                with self._news_lock:  # keep the news for the next master
                    self._dropped[:0] = dropped
                    self._moved[:0] = moved
            except Exception:
                log.exception("node %s: heartbeat loop error", self.node_id)

    def _on_store_event(self, key: str, event: str) -> None:
        if event == "removed":
            held = Held(key, 0, "", self.writes.forget(key))
            if self.master is not None:  # embedded: tell the master now, not a heartbeat later
                self.master.heartbeat(self.node_id, None, [held])
            else:
                with self._news_lock:
                    self._dropped.append(held)
        elif event in ("demoted", "promoted"):
            with self._news_lock:
                self._moved.append(Held(key, 0, "ssd" if event == "demoted" else "dram", self.writes.put_id_of(key)))

    def conn_closed(self, conn: ServerConn) -> None:
        """A client's connection ended: drop the pins it held and abort its open writes."""
        if self.pins is not None:
            self.pins.conn_closed(conn)
        if self.writes is not None:
            self.writes.conn_closed(conn)

    # ------------------------------------------------------------------ handlers

    def _on_get(self, msg: NodeGet, payload: Payload, conn: ServerConn) -> tuple:
        """The objects' bytes straight from the arena, pinned until the reply is sent (`release`)."""
        pins = self.pins
        if msg.unpin:
            pins.release(msg.unpin, conn)
        elif len(msg.keys) == 1:  # the common single get: no lists to build
            return pins.get_one(msg.keys[0], self.store.arena.buffer)
        pinned, offsets, sizes, copies, ssd = pins.pin(msg.keys)
        try:
            arena = self.store.arena.buffer
            views = [memoryview(copies[i]) if i in copies else arena[o:o + n]
                     for i, (o, n) in enumerate(zip(offsets, sizes)) if n >= 0]
        except BaseException:
            pins.unpin(pinned)
            raise
        return NodeData(sizes, ssd), views, lambda: pins.unpin(pinned)

    def _on_pin(self, msg: NodePin, payload: Payload, conn: ServerConn) -> tuple:
        pins = self.pins
        if msg.unpin:
            pins.release(msg.unpin, conn)
        pinned, offsets, sizes, copies, ssd = pins.pin(msg.keys)
        try:
            hits = [i for i, n in enumerate(sizes) if n >= 0 and i not in copies]
            # Small objects ride inline in the reply (a pin + memcpy costs more than the bytes), and
            # so do the unpinnable ones read from SSD (`copies`).
            inline = [i for i in hits if msg.inline and sizes[i] <= INLINE_MAX]
            kept = [msg.keys[i] for i in hits if not msg.inline or sizes[i] > INLINE_MAX]
            arena = self.store.arena.buffer
            views = [memoryview(copies[i]) if i in copies else arena[offsets[i]:offsets[i] + sizes[i]]
                     for i in sorted([*inline, *copies])]
            for i in inline:
                offsets[i] = -1
            pin_id = pins.hold(kept, conn) if kept else 0
        except BaseException:
            pins.unpin(pinned)
            raise
        sent = [msg.keys[i] for i in inline]  # pinned until the reply is sent
        try:
            granted = pins.grants(offsets, sizes, pin_id, conn.principal.name)
        except BaseException:
            pins.unpin(sent)
            raise
        return Pins(pin_id, offsets, sizes, granted, ssd), views, lambda: pins.unpin(sent)

    def _on_unpin(self, msg: NodeUnpin, payload: Payload, conn: ServerConn) -> None:
        self.pins.release(msg.pin_ids, conn)
        if msg.touched:
            if self.master is not None:
                for key in msg.touched:
                    self.master.touch(key)
            self.store.touch(msg.touched)

    def _on_write(self, msg: NodeWrite, payload: Payload, conn: ServerConn) -> WriteReply:
        check_sizes(msg.sizes, payload, "NodeWrite")
        write, checked = self.writes.write, bool(conn.scope)  # a tenant's keys were validated at dispatch
        tickets = msg.tickets or [b""] * len(msg.keys)
        return WriteReply(per_item(lambda key, size, put_id, ticket: write(key, size, put_id, payload, checked, ticket),
                                   msg.keys, msg.sizes, msg.put_ids, tickets))

    def _on_reserve(self, msg: NodeReserve, payload: Payload, conn: ServerConn) -> Slots:
        if msg.unpin:
            self.pins.release(msg.unpin, conn)
        if self.transfer_segment is None:
            raise Unavailable(f"node {self.node_id} has no transfer engine; write over the pool RPC")
        tickets = msg.tickets or [b""] * len(msg.keys)
        return Slots(per_item(lambda key, size, put_id, ticket: self.writes.open(key, size, put_id, conn, ticket),
                              msg.keys, msg.sizes, msg.put_ids, tickets), self.transfer_segment)

    def _on_commit(self, msg: NodeCommit, payload: Payload, conn: ServerConn) -> WriteReply:
        return WriteReply(per_item(lambda key, put_id, ok: self.writes.commit(key, put_id, ok, conn),
                                   msg.keys, msg.put_ids, msg.ok))

    def _on_remove(self, msg: NodeRemove, payload: Payload | None, conn: ServerConn | None) -> Bools:
        return Bools(per_item(self.writes.remove, msg.keys, msg.put_ids))

    def _on_copy(self, msg: NodeCopy, payload: Payload, conn: ServerConn) -> WriteReply:
        if len(msg.put_ids) != len(msg.keys):
            raise InvalidArgument("NodeCopy: keys and put_ids must have the same length")
        known = self.channel.node_addresses() if self.channel is not None else None
        if known is not None and (msg.source not in known or msg.source == self.rpc.address):
            raise Forbidden(f"NodeCopy: {msg.source} is not a registered node; copies come only from pool nodes")
        return WriteReply(self.writes.copy(list(msg.keys), list(msg.put_ids), msg.source))

    def _on_stats(self, msg: NodeStats, payload: Payload, conn: ServerConn) -> Info:
        info = msgspec.structs.asdict(self.info())  # how to reach the node: what it registers with
        doc = {k: v for k, v in info.items() if k not in ("segments", "capacity")}
        doc["arena_size"] = self.store.arena.size
        if conn is None or not conn.scope:  # a tenant learns how to reach the node, not the pool's traffic
            doc.update(self.store.stats())
        return Info(doc)

    # ------------------------------------------------------------------ the embedded master's link (no socket)

    def remove(self, keys: list[str], put_ids: list[int]) -> None:
        """As `NodeRemove`."""
        self._on_remove(NodeRemove(list(keys), list(put_ids)), None, None)

    def hide(self, keys: list[str], put_ids: list[int]) -> None:
        """Stop same-host readers finding these copies through the shm index (the embedded
        master dropped them; their removal follows). Only copies still written by that put."""
        store = self.store
        if store is None:
            return
        for key, put_id in zip(keys, put_ids):
            if self.writes.put_id_of(key) == put_id:  # 0: held since before a restart (`held`)
                store.hide(key)

    def copy(self, keys: list[str], put_ids: list[int], source: str) -> list:
        """As `NodeCopy`."""
        return self.writes.copy(list(keys), list(put_ids), source)

    def close(self) -> None:
        pass
