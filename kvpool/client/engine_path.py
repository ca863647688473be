"""The `engine` data path (chosen by `kvpool.client.datapath`): bytes move one-sided between the
caller's buffers and the nodes' arena segments through a `transfer.TransferEngine`; the node RPC
carries only control messages. For all nodes of a call at once: write = `NodeReserve`, one
engine batch of WRITEs, `NodeCommit` (to an embedded pool `PutReserve` and `PutCommit`, which
also start and end the puts at its master); read = `NodePin(inline=False)`, one batch of READs, the
pin released with the next request (a pinned object is never freed, so a read never returns
another object's bytes). A failed node or transfer is reported to the caller (another replica,
or that replica fails); the node aborts a reservation whose writer's connection closed or whose
put timed out. Not thread-safe: the owning client serializes calls.

Authentication on: the engine this path opens proves the same credential as the node RPC
(`RpcClient.credential`) to the nodes' data servers, and each op carries the node's grant for
its range (`Pins.grants`, `Slot.grant`): the data server moves nothing without one.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from kvpool.client.nodes import EXISTS, TOO_SMALL, NodeConn, fan_out, mark_tiers, node_tickets, written
from kvpool.errors import KVPoolError, Unavailable, error_from_code
from kvpool.messages import Err, NodeCommit, NodePin, NodeReserve, PutCommit, PutReserve, Slot

log = logging.getLogger(__name__)


class EnginePath:
    """`rdma_only`: move bytes over rdma only (the "auto" mode: the engine would otherwise
    prefer shm on this host). `engine`: a started TransferEngine to use (the caller owns it);
    else one is opened on first need with `transports` and closed by `close`."""

    name = "engine"

    def __init__(self, rdma_only: bool, engine: Any = None, transports: Sequence[str] | None = None,
                 timeout: float = 10.0):
        self._engine = engine
        self._own = engine is None
        self._transports = ("tcp", "rdma") if rdma_only else tuple(transports or ("shm", "tcp", "rdma"))
        self._timeout = timeout
        self._rdma_missing = False
        self.transport = "rdma" if rdma_only else None
        self._credential: Any = None  # what our own engine proves to nodes: the RPC's credential

    def engine(self):
        if self._engine is None:
            from transfer import TransferEngine

            from kvpool.config import current_settings

            cred, rpc = self._credential, current_settings().rpc
            self._engine = TransferEngine(transports=self._transports, timeout=self._timeout,
                                          credential=(cred.principal, cred.secret) if cred else None,
                                          rdma_device=rpc.rdma_device, rdma_gid_index=rpc.rdma_gid_index).start()
        return self._engine

    def _learn_credential(self, work: Sequence[tuple[NodeConn, list[int]]]) -> None:
        if self._credential is None and self._engine is None:
            for conn, _ in work:
                self._credential = getattr(conn.rpc, "credential", None)
                break

    def has_rdma(self) -> bool:
        """Whether this client's engine has an rdma device (asked once)."""
        if self._rdma_missing:
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
                move(op.remote, op.remote_offset, op.local, op.local_offset, op.length, self.transport, op.grant)
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
             views: Sequence[memoryview] | None, out: list, tiers: list | None = None) -> tuple[list[int], list[str]]:
        """Read keys[i] for the i of each (node, indexes) into out[i]: bytes (views None) or the
        size copied into views[i] (TOO_SMALL when it does not fit); misses are left as they are;
        tiers[i] (when `tiers` is a list): the tier that served it, "dram" | "ssd".
        Returns (indexes to retry on another replica, addresses of nodes that are gone)."""
        from transfer import READ, Op

        self._learn_credential(work)
        retry: list[int] = []
        dead: list[str] = []
        ops: list[Op] = []
        dests: list[tuple[int, Any]] = []
        pin_ids: list[tuple[NodeConn, int]] = []
        pin = lambda conn, idx: (NodePin([keys[i] for i in idx], conn.take_unpins(), inline=False), ())  # noqa: E731
        for conn, idx, pins in fan_out(work, pin):  # every node's pins were in flight at once
            if isinstance(pins, KVPoolError):
                retry.extend(idx)
                if isinstance(pins, Unavailable):
                    dead.append(conn.address)
                continue
            pin_ids.append((conn, pins.pin_id))
            if tiers is not None:
                mark_tiers(tiers, idx, pins.sizes, pins.ssd)
            desc = conn.transfer_segment()
            grants = pins.grants or [None] * len(idx)
            for i, offset, n, grant in zip(idx, pins.offsets, pins.sizes, grants):
                if n < 0:
                    continue
                if offset < 0:  # could not be pinned (DRAM full of pins): read from SSD, in the reply
                    if views is None:
                        out[i] = conn.rpc.read_payload(n)
                    elif n > len(views[i]):
                        conn.rpc.skip_payload(n)
                        out[i] = TOO_SMALL
                    else:
                        conn.rpc.read_payload_into(views[i][:n])
                        out[i] = n
                    continue
                if views is None:
                    dest: Any = bytearray(n)
                elif n > len(views[i]):
                    out[i] = TOO_SMALL
                    continue
                else:
                    dest = views[i]
                ops.append(Op(READ, dest, 0, desc, offset, n, grant or None))
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
              views: Sequence[memoryview], replicas: int = 0,
              tickets: Sequence[dict[str, bytes] | None] | None = None,
              token: int | None = None) -> dict[tuple[str, int], Any]:
        """Write views[i] to each (node, indexes) under put put_ids[i]; tickets[i]: the master's
        put tickets of key i by node address (or None). `token` (an embedded pool, whose server
        is the master: no put started yet): `PutReserve` / `PutCommit` start and end the puts
        with the reservation and the commit instead (`kvpool.embedded`).
        Returns {(address, i): Placed | EXISTS | a KVPoolError}."""
        from transfer import WRITE, Op

        self._learn_credential(work)
        result: dict[tuple[str, int], Any] = {}
        reserved = []
        ops: list[Op] = []
        owners: list[tuple[int, int]] = []  # op -> (reserved entry, position)
        def reserve(conn: NodeConn, idx: list[int]) -> tuple[NodeReserve | PutReserve, tuple]:
            sizes = [views[i].nbytes for i in idx]
            if token is not None:
                return PutReserve([keys[i] for i in idx], sizes, replicas, token, conn.take_unpins()), ()
            return NodeReserve([keys[i] for i in idx], sizes, [put_ids[i] for i in idx], replicas, conn.take_unpins(),
                               node_tickets(tickets, conn, idx)), ()

        for conn, idx, slots in fan_out(work, reserve):
            if isinstance(slots, KVPoolError):
                result.update(((conn.address, i), slots) for i in idx)
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
                    ops.append(Op(WRITE, views[i], 0, desc, slot.offset, views[i].nbytes, slot.grant or None))
                    owners.append((len(reserved), pos))
            reserved.append(entry)
        failures = self._run(ops)
        for j, (r, pos) in enumerate(owners):
            if j not in failures:
                reserved[r][3][pos] = True
            else:
                conn, idx = reserved[r][0], reserved[r][1]
                result[(conn.address, idx[pos])] = Unavailable(f"transfer to {conn.address} failed: {failures[j]}")

        def commit(conn: NodeConn, ctx: tuple) -> tuple[NodeCommit | PutCommit, tuple]:
            idx, todo, slots, ok = ctx
            end = NodeCommit if token is None else PutCommit
            return end([keys[idx[p]] for p in todo], [slots[p].put_id for p in todo], [ok[p] for p in todo]), ()

        to_commit = [(conn, (idx, todo, slots, ok)) for conn, idx, slots, ok in reserved
                     if (todo := [p for p, s in enumerate(slots) if isinstance(s, Slot) and s.offset >= 0])]
        for conn, (idx, todo, slots, ok), reply in fan_out(to_commit, commit):
            if isinstance(reply, KVPoolError):
                for p in todo:
                    result.setdefault((conn.address, idx[p]), reply)
                continue
            for p, res in zip(todo, reply.results):
                if not ok[p]:
                    continue  # the transfer's error is already recorded
                result[(conn.address, idx[p])] = written(res)
        return result
