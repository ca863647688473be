"""The SDK's transfer-engine data path: bulk bytes move one-sided between the caller's buffers
and the nodes' arena segments through a `transfer.TransferEngine` (tcp, or rdma where both ends
have a device); the nodes' RPC carries only the control messages, the master none of the bytes.

`data_path`, a `Client` option, picks the path per node:
- "rpc": bytes ride on the node's RPC port (same-host reads copy from the node's shm mapping);
- "engine": the engine, for every node that publishes a transfer segment (else rpc);
- "auto" (default): the engine where the client's engine and the node's segment share "rdma",
  else rpc (which is one round trip, and one memcpy on the same host: the engine's tcp path
  cannot beat it). A client that is given no engine opens one only when a node offers rdma.

Round trips per call, for the nodes on the engine path (all nodes of a batch at once):
- write: `NodeReserve` (offsets; embedded: the node plans the put itself), one engine batch of
  WRITEs for every replica, `NodeCommit` (embedded: the node publishes);
- read: `NodePin(inline=False)` (offsets, objects pinned), one engine batch of READs into the
  caller's buffers; the pin is released with the next request to that node (or `flush`), or
  by the node when the lease ends. A pinned object is never evicted or freed, so a read never
  returns bytes of another object.
Failures: a node that cannot be reached or whose transfer failed is reported to the caller,
which retries another replica (reads) or fails that replica (writes); the node aborts an
uncommitted reservation when the writer's connection closes or the put times out.
Not thread-safe: the owning client serializes calls.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from kvpool.client.nodes import TOO_SMALL, NodeConn
from kvpool.errors import InvalidArgument, KVPoolError, Unavailable, error_from_code
from kvpool.messages import Err, NodeCommit, NodePin, NodeReserve, Placed, Slot

log = logging.getLogger(__name__)

DATA_PATHS = ("auto", "rpc", "engine")
EXISTS = "exists"  # a write result: the key was already complete, nothing was written


class EnginePath:
    """`mode`: one of DATA_PATHS. `engine`: a started TransferEngine to use (the caller owns
    it); else one is opened on first need with `transports` and closed by `close`."""

    def __init__(self, mode: str = "auto", engine: Any = None, transports: Sequence[str] | None = None,
                 timeout: float = 10.0):
        if mode not in DATA_PATHS:
            raise InvalidArgument(f"data_path must be one of {list(DATA_PATHS)}, got {mode!r}")
        self.mode = mode
        self._engine = engine
        self._own = engine is None
        self._transports = tuple(transports) if transports else ("shm", "tcp", "rdma")
        self._timeout = timeout
        self._rdma_missing = False
        # auto mode moves bytes over rdma only; the engine would otherwise prefer shm on this host
        self.transport = "rdma" if mode == "auto" else None

    def engine(self):
        if self._engine is None:
            from transfer import TransferEngine

            transports = ("tcp", "rdma") if self.mode == "auto" else self._transports
            self._engine = TransferEngine(transports=transports, timeout=self._timeout).start()
        return self._engine

    def uses(self, conn: NodeConn) -> bool:
        """Whether bytes to and from this node go through the engine."""
        if self.mode == "rpc":
            return False
        desc = conn.transfer_segment()
        if desc is None:
            return False
        if self.mode == "engine":
            return True
        if "rdma" not in desc.transports or self._rdma_missing:
            return False
        if "rdma" not in self.engine().transports:
            self._rdma_missing = True  # no device here: never ask again
            if self._own:
                self.close()
            return False
        return True

    def close(self) -> None:
        if self._own and self._engine is not None:
            self._engine.close()
        self._engine = None

    def _run(self, ops: list) -> dict[int, BaseException]:
        """Move `ops` as one engine batch; returns the failed ops' errors by index."""
        from transfer import READ, TransferError

        if not ops:
            return {}
        engine = self.engine()
        try:
            if len(ops) == 1:  # a single op runs on this thread: no hand-off to the engine's threads
                op = ops[0]
                move = engine.read if op.opcode == READ else engine.write
                move(op.remote, op.remote_offset, op.local, op.local_offset, op.length, self.transport)
                return {}
            batch = engine.submit(ops, self.transport)
        except TransferError as exc:  # a single op's failure, or a batch refused before any byte moved
            return dict.fromkeys(range(len(ops)), exc)
        try:
            batch.wait()
        except TransferError:
            return batch.failures
        return {}

    # ------------------------------------------------------------------ reads

    def read(self, work: Sequence[tuple[NodeConn, list[int]]], keys: Sequence[str],
             views: Sequence[memoryview] | None, out: list) -> tuple[list[int], list[str]]:
        """Read keys[i] for the i of each (node, indexes) into out[i]: bytes (views None) or the
        size copied into views[i] (TOO_SMALL when it does not fit); misses are left as they are.
        Returns (indexes to retry on another replica, addresses of nodes that are gone)."""
        retry: list[int] = []
        dead: list[str] = []
        sent = []
        for conn, idx in work:  # every node's pins in flight at once
            try:
                conn.rpc.send_request(NodePin([keys[i] for i in idx], conn.take_unpins(), inline=False))
                sent.append((conn, idx))
            except Unavailable:
                retry.extend(idx)
                dead.append(conn.address)
        from transfer import READ, Op

        ops: list[Op] = []
        dests: list[tuple[int, Any]] = []
        pin_ids: list[tuple[NodeConn, int]] = []
        for conn, idx in sent:
            try:
                pins = conn.rpc.recv_reply()
            except KVPoolError as exc:  # read the other replies anyway: each socket stays in step
                retry.extend(idx)
                if isinstance(exc, Unavailable):
                    dead.append(conn.address)
                continue
            pin_ids.append((conn, pins.pin_id))
            desc = conn.transfer_segment()
            # Objects the node could not pin (DRAM full of pinned objects) come inline, read
            # from its SSD: offset -1, in order, in the reply's payload.
            for i, offset, n in zip(idx, pins.offsets, pins.sizes):
                if n < 0 or offset >= 0:
                    continue
                if views is None:
                    out[i] = conn.rpc.read_payload(n)
                elif n > len(views[i]):
                    conn.rpc.skip_payload(n)
                    out[i] = TOO_SMALL
                else:
                    conn.rpc.read_payload_into(views[i][:n])
                    out[i] = n
            for i, offset, n in zip(idx, pins.offsets, pins.sizes):
                if n < 0 or offset < 0:
                    continue
                if views is None:
                    dest: Any = bytearray(n)
                elif n > len(views[i]):
                    out[i] = TOO_SMALL
                    continue
                else:
                    dest = views[i]
                ops.append(Op(READ, dest, 0, desc, offset, n))
                dests.append((i, dest))
        try:
            failures = self._run(ops)
        finally:
            for conn, pin_id in pin_ids:  # only now: the bytes are out of the arena
                conn.unpin_later(pin_id)
        for j, (i, dest) in enumerate(dests):
            if j in failures:
                log.info("engine read of %r failed: %s", keys[i], failures[j])
                retry.append(i)
            elif views is None:
                out[i] = bytes(dest)
            else:
                out[i] = ops[j].length
        return retry, dead

    # ------------------------------------------------------------------ writes

    def write(self, work: Sequence[tuple[NodeConn, list[int]]], keys: Sequence[str], put_ids: Sequence[int],
              views: Sequence[memoryview], replicas: int = 0) -> dict[tuple[str, int], Any]:
        """Write views[i] to each (node, indexes); put_ids[i] == 0: the node plans the put
        (embedded). Returns {(address, i): Placed | EXISTS | a KVPoolError}."""
        from transfer import WRITE, Op

        result: dict[tuple[str, int], Any] = {}
        sent = []
        for conn, idx in work:
            try:
                conn.rpc.send_request(NodeReserve([keys[i] for i in idx], [views[i].nbytes for i in idx],
                                                  [put_ids[i] for i in idx], replicas, conn.take_unpins()))
                sent.append((conn, idx))
            except Unavailable as exc:
                result.update(((conn.address, i), exc) for i in idx)
        reserved = []
        ops: list[Op] = []
        owners: list[tuple[int, int]] = []  # op -> (reserved entry, position)
        for conn, idx in sent:
            try:
                slots = conn.rpc.recv_reply()
            except KVPoolError as exc:
                result.update(((conn.address, i), exc) for i in idx)
                continue
            conn.remember_segment(slots.segment)
            desc = conn.transfer_segment()
            entry = (conn, idx, slots.results, [False] * len(idx))
            for pos, (i, slot) in enumerate(zip(idx, slots.results)):
                if isinstance(slot, Err):
                    result[(conn.address, i)] = error_from_code(slot.code, slot.message)
                elif slot.offset < 0:
                    result[(conn.address, i)] = EXISTS
                else:
                    ops.append(Op(WRITE, views[i], 0, desc, slot.offset, views[i].nbytes))
                    owners.append((len(reserved), pos))
            reserved.append(entry)
        failures = self._run(ops)
        for j, (r, pos) in enumerate(owners):
            if j not in failures:
                reserved[r][3][pos] = True
            else:
                conn, idx = reserved[r][0], reserved[r][1]
                result[(conn.address, idx[pos])] = Unavailable(f"transfer to {conn.address} failed: {failures[j]}")
        committing = []
        for conn, idx, slots, ok in reserved:
            todo = [pos for pos, s in enumerate(slots) if isinstance(s, Slot) and s.offset >= 0]
            if not todo:
                continue
            try:
                conn.rpc.send_request(NodeCommit([keys[idx[p]] for p in todo], [slots[p].put_id for p in todo],
                                                 [ok[p] for p in todo]))
                committing.append((conn, idx, todo, ok))
            except Unavailable as exc:
                for p in todo:
                    result.setdefault((conn.address, idx[p]), exc)
        for conn, idx, todo, ok in committing:
            try:
                replies = conn.rpc.recv_reply().results
            except KVPoolError as exc:
                for p in todo:
                    result.setdefault((conn.address, idx[p]), exc)
                continue
            for p, res in zip(todo, replies):
                if not ok[p]:
                    continue  # the transfer's error is already recorded
                if isinstance(res, Placed):
                    result[(conn.address, idx[p])] = res
                else:
                    result[(conn.address, idx[p])] = error_from_code(res.code, res.message)
        return result
