"""`StoreNode`: one node of the pool. Owns a `TieredStore`, serves reads and writes, heartbeats.

Data path (all on the node's RPC port, one round trip each):
- `NodeGet`: pin each object (promoting it from SSD if needed), send its bytes straight from the
  arena with `sendmsg`, unpin. A pinned object is never evicted mid-send.
- Same-host readers first look the key up in the node's DRAM index in shared memory
  (`kvpool.tiers.shm_index`) and copy from their own mapping of the arena: no round trip at all.
  They report those reads in batches (`NodeUnpin.touched`: hits, recency for eviction).
- `NodePin` / `NodeUnpin`: otherwise a same-host reader pins, copies from its mapping of the
  arena (the shm file), and unpins with its next request (piggy-backed) or a one-way `NodeUnpin`.
  Pins held by a connection are dropped when it closes, and any pin older than the lease expires.
- `NodeWrite`: reserve in the arena, `recv_into` the reservation, commit. A write that dies
  half-way is aborted, so a half-written object is never visible. With `put_id == 0` and a master
  in this process (embedded mode) the node plans and publishes the put itself: one round trip.
- `NodeCopy`: pull objects from another node (the master's drain), master stays off the data path.
- `NodeReserve` / `NodeCommit` (see `kvpool.node_engine`): the transfer-engine data path; the
  writer moves the bytes one-sided into the arena segment between the two. Reads on that path
  are `NodePin(inline=False)` and a one-sided READ, the pin held until the reader's next request.

The node remembers which put wrote each object (`put_id`), and `NodeRemove` removes a copy only
if it is still that put's, so a late removal from the master never deletes a newer object.
Objects the store evicts by its own policy are reported to the master with the next heartbeat.
The arena is also registered with the transfer engine (when available; `engine=` passes one in,
e.g. with an RDMA device), and its descriptor is published in `NodeInfo.transfer_segment` (and
`NodeStats`) for peers that move bytes with `transfer`.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

from kvpool.api import check_key
from kvpool.config import Settings
from kvpool.errors import CapacityError, InvalidArgument, KVPoolError, Unavailable
from kvpool.messages import (Bools, Err, Held, Info, NodeCommit, NodeCopy, NodeData, NodeGet, NodeInfo, NodePin,
                             NodeRemove, NodeReserve, NodeStats, NodeUnpin, NodeWrite, Pins, Placed, WriteReply)
from kvpool.node_engine import EngineWrites
from kvpool.node_link import MasterChannel
from kvpool.rpc import Payload, RpcClient, RpcServer, ServerConn

log = logging.getLogger(__name__)

INLINE_MAX = 32 * 1024  # NodePin sends objects up to this size in the reply instead of pinning them


class StoreNode(EngineWrites):
    """A store node. `master`: a `MasterService` in this process (embedded mode), else None.
    `engine`: a started `transfer.TransferEngine` to register the arena with (the caller owns
    it); default: the node starts its own with `settings.transports`."""

    def __init__(self, settings: Settings, *, master: Any = None, store: Any = None, rpc: RpcServer | None = None,
                 engine: Any = None):
        self.settings = settings
        self.master = master
        self._store = store
        self._rpc_external = rpc is not None
        self.rpc = rpc
        self.node_id = settings.node_id or ""
        self.segment = ""
        self._put_ids: dict[str, int] = {}
        self._pins: dict[int, tuple[list[str], float]] = {}
        self._writing: dict[str, Any] = {}  # key -> node_engine._Write (reserved, not yet committed)
        self._pin_seq = 0
        self._lock = threading.Lock()
        self._dropped: list[Held] = []
        self._moved: list[Held] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.channel: MasterChannel | None = None
        self.engine = engine
        self._engine_external = engine is not None
        self.transfer_segment: bytes | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def store(self):
        return self._store

    def handlers(self) -> dict[type, Any]:
        table = {NodeGet: self._on_get, NodePin: self._on_pin, NodeUnpin: self._on_unpin, NodeWrite: self._on_write,
                 NodeRemove: self._on_remove, NodeCopy: self._on_copy, NodeStats: self._on_stats,
                 NodeReserve: self._on_reserve, NodeCommit: self._on_commit}
        return {kind: self._while_open(handler) for kind, handler in table.items()}

    def _while_open(self, handler: Any) -> Any:
        """A request still in flight when `stop` closed the store gets `Unavailable`, not a crash."""
        def guarded(msg: Any, payload: Payload, conn: ServerConn) -> Any:
            if self._store is None:
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
        if self._store is None:
            from kvpool.tiers import TieredStore

            self._store = TieredStore.from_settings(s)
        self._store.on_evict = self._on_store_event
        if self.rpc is None:
            self.rpc = RpcServer(self.handlers(), s.host, s.port, name="node", on_close=self._on_conn_close).start()
        self.node_id = self.node_id or f"{socket.gethostname()}:{self.rpc.port}"
        self.segment = f"{self.node_id}/dram"
        self._start_transfer_engine()
        if self.master is not None:
            self.channel = MasterChannel.local(self.master)
        else:
            self.channel = MasterChannel.remote(s)
        self._register()
        self._thread = threading.Thread(target=self._heartbeat_loop, name="node-heartbeat", daemon=True)
        self._thread.start()
        log.info("node %s serving at %s (DRAM %d bytes, shm %s)", self.node_id, self.rpc.address,
                 self._store.arena.size, self._store.arena.path)
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.rpc is not None and not self._rpc_external:
            self.rpc.stop()
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.engine is not None:
            try:
                if self._engine_external:
                    if self.transfer_segment is not None:
                        self.engine.unregister(self.segment)
                else:
                    self.engine.close()
            except Exception:
                log.debug("closing the transfer engine failed", exc_info=True)
            self.engine = None
        if self._store is not None:
            self._store.close()
            self._store = None

    def _start_transfer_engine(self) -> None:
        """Expose the arena to `transfer` peers; the pool works without it (our RPC carries bytes)."""
        try:
            from transfer import TransferEngine

            if self.engine is None:
                transports = [t for t in self.settings.transports if t in ("shm", "tcp", "rdma")]
                self.engine = TransferEngine(name=f"kvpool-{self.node_id}", host=self.settings.host,
                                             transports=transports or ("tcp",)).start()
            desc = self.engine.register(self._store.arena.buffer, name=self.segment, shm_path=self._store.arena.path)
            self.transfer_segment = desc.to_bytes()
        except Exception as exc:  # an optional path: log and carry on
            log.warning("node %s: transfer engine unavailable (%s); serving over the pool RPC only",
                        self.node_id, exc)
            if not self._engine_external:
                self.engine = None

    def info(self) -> NodeInfo:
        s = self.settings
        capacity = {"dram": self._store.arena.size}
        if s.ssd_path:
            capacity["ssd"] = s.ssd_capacity
        return NodeInfo(node_id=self.node_id, address=self.rpc.address, hostname=socket.gethostname(),
                        segments=[self.segment], shm_path=self._store.arena.path, capacity=capacity,
                        transfer_segment=self.transfer_segment, index_path=self._index_path(),
                        unix=self.rpc.unix_address)

    def _index_path(self) -> str | None:
        index = getattr(getattr(self._store, "dram", None), "index", None)
        return None if index is None else index.path

    def held(self) -> list[Held]:
        return [Held(k, size, tier, self._put_ids.get(k, 0)) for k, size, tier in self._store.keys()]

    def _register(self) -> None:
        try:
            self.channel.register(self.info(), self.held())
        except KVPoolError as exc:
            log.warning("node %s: registration failed (%s); retrying with the next heartbeat", self.node_id, exc)

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.settings.heartbeat_s):
            self._expire_pins()
            self._expire_writes()
            with self._lock:
                dropped, self._dropped = self._dropped, []
                moved, self._moved = self._moved, []
            try:
                stats = self._store.stats()
                if not self.channel.heartbeat(self.node_id, stats, dropped, moved) or self.channel.changed:
                    self.channel.changed = False
                    self.channel.register(self.info(), self.held())
            except KVPoolError as exc:
                log.info("node %s: heartbeat failed (%s)", self.node_id, exc)
                with self._lock:  # keep the news for the next master
                    self._dropped[:0] = dropped
                    self._moved[:0] = moved
            except Exception:
                log.exception("node %s: heartbeat loop error", self.node_id)

    # ------------------------------------------------------------------ store events

    def _on_store_event(self, key: str, event: str) -> None:
        if event == "removed":
            with self._lock:
                held = Held(key, 0, "", self._put_ids.pop(key, 0))
                if self.master is None:
                    self._dropped.append(held)
            if self.master is not None:  # embedded: tell the master now, not a heartbeat later
                self.master.heartbeat(self.node_id, None, [held])
        elif event in ("demoted", "promoted"):
            with self._lock:
                self._moved.append(Held(key, 0, "ssd" if event == "demoted" else "dram", self._put_ids.get(key, 0)))

    # ------------------------------------------------------------------ pins

    def _pin_batch(self, keys: list[str]) -> tuple[list[str], list[int], list[int], dict[int, bytes]]:
        """Pin each key in DRAM: (pinned keys, offsets, sizes (-1: miss), copies).

        A batch larger than free DRAM cannot have all its SSD objects promoted and pinned at
        once; those (CapacityError) are read straight from SSD into `copies[i]` instead of
        being reported as misses."""
        pinned, offsets, sizes = [], [], []
        copies: dict[int, bytes] = {}
        for i, key in enumerate(keys):
            if self.master is not None and not self.master.touch(key):
                offsets.append(0)
                sizes.append(-1)
                continue
            try:
                loc = self._store.pin(key)
            except CapacityError:  # DRAM all pinned: serve this one from SSD without promoting
                data = self._store.get(key)
                offsets.append(-1)
                sizes.append(-1 if data is None else len(data))
                if data is not None:
                    copies[i] = data
                continue
            except (KVPoolError, ValueError):  # absent, being removed: a miss
                offsets.append(0)
                sizes.append(-1)
                continue
            pinned.append(key)
            offsets.append(loc.offset)
            sizes.append(loc.length)
        return pinned, offsets, sizes, copies

    def _unpin_keys(self, keys: list[str]) -> None:
        store = self._store
        if store is None:  # stopped: the pins went with the store
            return
        for key in keys:
            try:
                store.unpin(key)
            except KVPoolError:
                log.debug("unpin of %r: not pinned", key)

    def _unpin_ids(self, pin_ids: list[int], conn: ServerConn | None = None) -> None:
        for pid in pin_ids:
            with self._lock:
                entry = self._pins.pop(pid, None)
            if entry is not None:
                self._unpin_keys(entry[0])
            if conn is not None:
                conn.state.get("pins", set()).discard(pid)

    def _expire_pins(self) -> None:
        now = time.monotonic()
        with self._lock:
            stale = [pid for pid, (_, until) in self._pins.items() if until <= now]
        if stale:
            log.info("node %s: %d shm pin(s) expired without an unpin", self.node_id, len(stale))
            self._unpin_ids(stale)

    def _on_conn_close(self, conn: ServerConn) -> None:
        self._unpin_ids(list(conn.state.get("pins", ())))
        self._abort_conn_writes(conn)

    # ------------------------------------------------------------------ handlers

    def _on_get(self, msg: NodeGet, payload: Payload, conn: ServerConn) -> None:
        if msg.unpin:
            self._unpin_ids(msg.unpin, conn)
        pinned, offsets, sizes, copies = self._pin_batch(msg.keys)
        try:
            arena = self._store.arena.buffer
            views = [memoryview(copies[i]) if i in copies else arena[o:o + n]
                     for i, (o, n) in enumerate(zip(offsets, sizes)) if n >= 0]
            conn.reply(NodeData(sizes), views)
        finally:
            self._unpin_keys(pinned)

    def _on_pin(self, msg: NodePin, payload: Payload, conn: ServerConn) -> None:
        if msg.unpin:
            self._unpin_ids(msg.unpin, conn)
        _, offsets, sizes, copies = self._pin_batch(msg.keys)
        hits = [i for i, n in enumerate(sizes) if n >= 0 and i not in copies]
        # Small objects ride inline in the reply (a pin + memcpy costs more than the bytes), and
        # so do the unpinnable ones read from SSD (`copies`).
        inline = [i for i in hits if msg.inline and sizes[i] <= INLINE_MAX]
        kept = [msg.keys[i] for i in hits if not msg.inline or sizes[i] > INLINE_MAX]
        arena = self._store.arena.buffer
        views = [memoryview(copies[i]) if i in copies else arena[offsets[i]:offsets[i] + sizes[i]]
                 for i in sorted([*inline, *copies])]
        for i in inline:
            offsets[i] = -1
        pin_id = 0
        if kept:
            with self._lock:
                self._pin_seq += 1
                pin_id = self._pin_seq
                self._pins[pin_id] = (kept, time.monotonic() + self.settings.lease_s)
            conn.state.setdefault("pins", set()).add(pin_id)
        try:
            conn.reply(Pins(pin_id, offsets, sizes), views)
        finally:
            self._unpin_keys([msg.keys[i] for i in inline])

    def _on_unpin(self, msg: NodeUnpin, payload: Payload, conn: ServerConn) -> None:
        self._unpin_ids(msg.pin_ids, conn)
        if msg.touched:
            if self.master is not None:
                for key in msg.touched:
                    self.master.touch(key)
            self._store.touch(msg.touched)

    def _on_write(self, msg: NodeWrite, payload: Payload, conn: ServerConn) -> WriteReply:
        n = len(msg.keys)
        if len(msg.sizes) != n or len(msg.put_ids) != n:
            raise InvalidArgument("NodeWrite: keys, sizes and put_ids must have the same length")
        if any(not isinstance(s, int) or s <= 0 for s in msg.sizes) or sum(msg.sizes) != payload.length:
            raise InvalidArgument(f"NodeWrite: sizes must be positive and add up to the payload ({payload.length})")
        replicas, results = msg.replicas, []
        for key, size, put_id in zip(msg.keys, msg.sizes, msg.put_ids):  # per_key_or_err, inlined
            try:
                results.append(self._write_one(key, size, put_id, replicas, payload))
            except KVPoolError as exc:
                results.append(Err(exc.code, str(exc)))
        return WriteReply(results)

    def _write_one(self, key: str, size: int, put_id: int, replicas: int, payload: Payload) -> Placed:
        local = False
        try:
            check_key(key)
            planned = self._plan_write(key, size, put_id, replicas)
            if planned is None:
                payload.skip(size)
                return Placed(self.node_id, "", "", -1)
            put_id, local = planned
            res = self._reserve(key, size, put_id)
        except BaseException:
            payload.skip(size)
            if local:
                self.master.put_abort(key, put_id)
            raise
        try:
            payload.read_into(self._store.arena.buffer[res.offset:res.offset + size])
        except BaseException:
            self._store.abort(key)  # a half-written object is never visible
            if local:
                self.master.put_abort(key, put_id)
            raise
        return self._publish(key, put_id, res.offset, local)

    def _plan_write(self, key: str, size: int, put_id: int, replicas: int) -> tuple[int, bool] | None:
        """(put id, local) of a write of `key` to this node; None when the object already exists.

        put_id 0 is a one-round-trip put: planned here at the in-process master, which must place
        it on this node alone (local: the caller publishes or aborts it there). Any other put id
        must be a put the master expects on this node."""
        if put_id == 0:
            if self.master is None:
                raise InvalidArgument("this node has no master in process; start the put at the master")
            plan = self.master.put_start(key, size, replicas or None, writer_node=self.node_id)
            if plan.exists:
                return None
            targets = plan.targets
            if len(targets) != 1 or targets[0].node_id != self.node_id:
                self.master.put_abort(key, plan.put_id)
                raise InvalidArgument("a one-round-trip put needs a single-node plan; use put_start")
            return plan.put_id, True
        if self.master is not None and not self.master.expects_write(key, put_id, self.node_id):
            raise InvalidArgument(f"no pending put {put_id} of {key!r} on this node")
        return put_id, False

    def _publish(self, key: str, put_id: int, offset: int, local: bool) -> Placed:
        """Make the written reservation of `key` visible (and, for a local put, end it at the master)."""
        with self._lock:
            self._put_ids[key] = put_id
        self._store.commit(key)
        placed = Placed(self.node_id, "dram", self.segment, offset)
        if local:
            self.master.put_end(key, put_id, [placed])  # raises if reclaimed meanwhile
        return placed

    def _reserve(self, key: str, size: int, put_id: int):
        if self._store.contains(key) and self._put_ids.get(key) != put_id:
            # The master planned a new put, so this copy is stale (its removal is still queued).
            self._store.remove(key)
        return self._store.reserve(key, size)

    def _on_remove(self, msg: NodeRemove, payload: Payload, conn: ServerConn) -> Bools:
        if len(msg.put_ids) != len(msg.keys):
            raise InvalidArgument("NodeRemove: keys and put_ids must have the same length")
        out = []
        for key, put_id in zip(msg.keys, msg.put_ids):
            if self._abort_write(key, put_id):  # a reclaimed put still reserved here
                out.append(True)
                continue
            with self._lock:
                ours = put_id == 0 or self._put_ids.get(key, 0) in (put_id, 0)
            try:
                out.append(ours and self._store.remove(key))
            except KVPoolError:
                out.append(False)
        return Bools(out)

    def _on_copy(self, msg: NodeCopy, payload: Payload, conn: ServerConn) -> WriteReply:
        if len(msg.put_ids) != len(msg.keys):
            raise InvalidArgument("NodeCopy: keys and put_ids must have the same length")
        source = RpcClient(msg.source, timeout=30.0)
        try:
            sizes = source.call(NodeGet(list(msg.keys))).sizes
            results: list[Placed | Err] = []
            for key, put_id, size in zip(msg.keys, msg.put_ids, sizes):
                if size < 0:
                    results.append(Err("not_found", f"{key!r} is not on {msg.source}"))
                    continue
                try:
                    res = self._reserve(key, size, put_id)
                except KVPoolError as exc:
                    source.skip_payload(size)
                    results.append(Err(exc.code, str(exc)))
                    continue
                try:
                    source.read_payload_into(self._store.arena.buffer[res.offset:res.offset + size])
                except BaseException:
                    self._store.abort(key)
                    raise
                results.append(self._publish(key, put_id, res.offset, local=False))
            return WriteReply(results)
        finally:
            source.close()

    def _on_stats(self, msg: NodeStats, payload: Payload, conn: ServerConn) -> Info:
        arena = self._store.arena
        return Info({"node_id": self.node_id, "address": self.rpc.address, "hostname": socket.gethostname(),
                     "shm_path": arena.path, "arena_size": arena.size, "transfer_segment": self.transfer_segment,
                     "index_path": self._index_path(), "unix": self.rpc.unix_address,
                     **self._store.stats()})

    # In-process link for the embedded master (same semantics as NodeRemove, no socket).
    def remove(self, keys: list[str], put_ids: list[int]) -> None:
        self._on_remove(NodeRemove(list(keys), list(put_ids)), None, None)  # type: ignore[arg-type]

    def hide(self, keys: list[str], put_ids: list[int]) -> None:
        """Stop same-host readers finding these copies through the shm index (the embedded
        master dropped them; their removal follows). Only copies still written by that put."""
        store = self._store
        if store is None:
            return
        for key, put_id in zip(keys, put_ids):
            if self._put_ids.get(key, 0) == put_id:  # 0: held since before a restart (`held`)
                store.hide(key)

    def copy(self, keys: list[str], put_ids: list[int], source: str) -> list:
        return self._on_copy(NodeCopy(list(keys), list(put_ids), source), None, None).results  # type: ignore[arg-type]

    def close(self) -> None:
        pass
