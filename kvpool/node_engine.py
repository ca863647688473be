"""Two-phase writes for the transfer-engine data path of a `StoreNode` (a mixin of it).

The writer moves the bytes itself, one-sided, through `transfer` (tcp or rdma) into the node's
arena segment; the node only reserves and commits:

- `NodeReserve`: `store.reserve` each object and answer its arena offset (and the segment
  descriptor). With `put_id == 0` and a master in this process (embedded mode) the node plans
  the put itself, so the master is asked nothing over the network.
- `NodeCommit`: commit each reservation whose bytes landed (embedded mode: also publish it at
  the master), abort the others.

Invariants:
- a reservation is in `_writing` (key -> `_Write`) from its reserve until exactly one of commit,
  abort, a `NodeRemove` naming its put (the master reclaimed the put), the close of the
  connection that reserved it, or its deadline (`put_timeout_s`): whoever pops it under
  `_lock` finishes it, so a reservation is committed or aborted once, never both;
- a reserved object is invisible until committed, so readers never see a half-written one.
Known limit: one-sided writes cannot be recalled, so a writer must finish its transfers within
the put timeout (the SDK's engine timeout is shorter); a write landing after its reservation
was aborted and reused would corrupt the new object.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from kvpool.api import check_key
from kvpool.errors import InvalidArgument, KVPoolError, Unavailable
from kvpool.messages import Err, NodeCommit, NodeReserve, Placed, Slot, Slots, WriteReply

log = logging.getLogger(__name__)


@dataclass
class _Write:
    put_id: int
    offset: int
    deadline: float
    local: bool  # planned by the in-process master: publish / abort there too
    conn: object = None


def per_key_or_err(one: Callable[..., Any], *columns: Sequence[Any]) -> list[Any]:
    """`one(*row)` for each row of the parallel `columns`; a `KVPoolError` becomes that row's `Err`."""
    results: list[Any] = []
    for row in zip(*columns):
        try:
            results.append(one(*row))
        except KVPoolError as exc:
            results.append(Err(exc.code, str(exc)))
    return results


class EngineWrites:
    """Handlers of `NodeReserve` / `NodeCommit`; expects StoreNode's attributes."""

    def _on_reserve(self, msg: NodeReserve, payload, conn) -> Slots:
        n = len(msg.keys)
        if len(msg.sizes) != n or len(msg.put_ids) != n:
            raise InvalidArgument("NodeReserve: keys, sizes and put_ids must have the same length")
        if msg.unpin:
            self._unpin_ids(msg.unpin, conn)
        if self.transfer_segment is None:
            raise Unavailable(f"node {self.node_id} has no transfer engine; write over the pool RPC")
        results = per_key_or_err(lambda key, size, put_id: self._reserve_one(key, size, put_id, msg.replicas, conn),
                                 msg.keys, msg.sizes, msg.put_ids)
        return Slots(results, self.transfer_segment)

    def _reserve_one(self, key: str, size: int, put_id: int, replicas: int, conn) -> Slot:
        check_key(key)
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise InvalidArgument(f"NodeReserve: size must be a positive integer, got {size!r}")
        planned = self._plan_write(key, size, put_id, replicas)
        if planned is None:
            return Slot(0, -1)
        put_id, local = planned
        try:
            res = self._reserve(key, size, put_id)
        except BaseException:
            if local:
                self.master.put_abort(key, put_id)
            raise
        write = _Write(put_id, res.offset, time.monotonic() + self.settings.put_timeout_s, local, conn)
        with self._lock:
            self._writing[key] = write
        if conn is not None:
            conn.state.setdefault("writing", set()).add((key, put_id))
        return Slot(put_id, res.offset)

    def _on_commit(self, msg: NodeCommit, payload, conn) -> WriteReply:
        if len(msg.put_ids) != len(msg.keys) or len(msg.ok) != len(msg.keys):
            raise InvalidArgument("NodeCommit: keys, put_ids and ok must have the same length")
        results: list[Placed | Err] = []
        for key, put_id, ok in zip(msg.keys, msg.put_ids, msg.ok):
            write = self._take_write(key, put_id)
            if conn is not None:
                conn.state.get("writing", set()).discard((key, put_id))
            if write is None:
                results.append(Err(Unavailable.code, f"no reservation of put {put_id} of {key!r} "
                                                     "(reclaimed, expired or never made)"))
                continue
            if not ok:
                self._finish_abort(key, write)
                results.append(Err(Unavailable.code, f"put {put_id} of {key!r} aborted by its writer"))
                continue
            try:
                results.append(self._publish(key, write.put_id, write.offset, write.local))
            except KVPoolError as exc:
                results.append(Err(exc.code, str(exc)))
        return WriteReply(results)

    def _take_write(self, key: str, put_id: int) -> _Write | None:
        with self._lock:
            write = self._writing.get(key)
            if write is None or (put_id and write.put_id != put_id):
                return None
            return self._writing.pop(key)

    def _finish_abort(self, key: str, write: _Write) -> None:
        try:
            self._store.abort(key)
        except KVPoolError:
            log.debug("abort of %r: no reservation", key)
        if write.local and self.master is not None:
            self.master.put_abort(key, write.put_id)

    def _abort_write(self, key: str, put_id: int) -> bool:
        """Abort the reservation of put `put_id` of `key`, if it is still open (master reclaim)."""
        write = self._take_write(key, put_id)
        if write is None:
            return False
        self._finish_abort(key, write)
        return True

    def _expire_writes(self) -> None:
        now = time.monotonic()
        with self._lock:
            stale = [(k, w.put_id) for k, w in self._writing.items() if w.deadline <= now]
        for key, put_id in stale:
            if self._abort_write(key, put_id):
                log.info("node %s: reservation of %r (put %d) expired without a commit", self.node_id, key, put_id)

    def _abort_conn_writes(self, conn) -> None:
        """The writer's connection closed: its open reservations will never be committed."""
        for key, put_id in list(conn.state.get("writing", ())):
            with self._lock:
                write = self._writing.get(key)
                mine = write is not None and write.put_id == put_id and write.conn is conn
            if mine:
                self._abort_write(key, put_id)
