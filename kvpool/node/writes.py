"""Writes into one store node: plan, reserve, fill, publish; and the removals that race them.

Every write reserves arena space (`TieredStore.reserve`), fills it, then commits it: a reserved
object is invisible, so readers never see a half-written one. The bytes arrive in a `NodeWrite`
payload (`write`), from another node's `NodeGet` reply (`copy`, the master's drain), or one-sided
through `transfer` between `NodeReserve` and `NodeCommit` (`open`, `commit`). A client's write
is always under a put the master granted (`PutStart`; embedded mode too, `kvpool.embedded`):
put id 0 is refused. Each copy remembers the put that wrote it (`put_id_of`) and a removal
names the put it means, so a late removal never deletes a newer object.

Invariant: an open reservation lives in `_open` until exactly one of commit, abort, a removal
naming its put, the close of its writer's connection, or its deadline (`put_timeout_s`); whoever
pops it under the lock finishes it. With grants (authentication on) the WRITE grant handed out
with a reservation (to the writer's principal: only its own data connections may use it) expires at its deadline and is revoked when the reservation ends (commit,
abort, expiry, a removal, its writer's connection closing), before its range is published or
freed: the data server refuses any later WRITE frame, and the revocation returns only once no
frame started under the grant still writes (it waits for them briefly, then cuts them:
`transfer.grant`), so no byte of an ended reservation lands in a reused range. Without grants
(authentication off, loopback only) a one-sided write cannot be recalled: a writer must finish
within the put timeout.

Keys: `write`, `open` and `copy` are the node's boundary for the keys of a write request: each
validates an item's key once, as the pool stores it (`check_stored_key`; a bad one fails that
item only), unless the RPC dispatch already did (a tenant's keys, validated and scoped by
`kvpool.security.authz`: `checked`); everything below them (`TieredStore.reserve` / `commit` /
`abort`) trusts it. (The in-process master's `put_start` still checks its own.)

Deadlines: a `NodeWrite` whose payload is still arriving at its put deadline has its connection
cut (`Payload.cut`; the reservation is then aborted by the write itself, so no byte lands in a
reused range), and an open reservation past its deadline is aborted: a stalled writer never
holds arena space past `put_timeout_s` (checked each heartbeat).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from kvpool.errors import Forbidden, InvalidArgument, KVPoolError, Unavailable
from kvpool.contract import check_stored_key as check_key
from kvpool.messages import Err, NodeGet, Placed, Slot
from kvpool.rpc import Payload, RpcClient
from kvpool.security.tickets import Spent, Tickets
from transfer import WRITE

log = logging.getLogger("kvpool.node")


@dataclass
class _Open:
    put_id: int
    offset: int
    deadline: float
    conn: object = None
    grant: bytes = b""  # the WRITE grant handed out with it (revoked when it ends)


class Writes:
    """`store`: the node's `TieredStore`; `master`: the in-process `MasterService` (embedded
    mode) or None; `node_id`, `segment`: what a `Placed` names; `put_timeout_s`: how long an
    open reservation may wait for its commit. `sign`: (op, offset, length, ttl_s, principal) -> a
    grant of the transfer segment, set once the engine is up (None: no grants)."""

    def __init__(self, store: Any, node_id: str, segment: str, put_timeout_s: float, master: Any = None):
        self.store = store
        self.master = master
        self.node_id = node_id
        self.segment = segment
        self.put_timeout_s = put_timeout_s
        self.sign: Callable[[int, int, int, float, str], bytes | None] | None = None
        # a cluster node with a keyring: the master's put tickets, checked on every write it did not plan
        self.tickets: Tickets | None = None
        self._spent = Spent()
        self.revoke: Callable[[bytes], None] | None = None
        self._put_ids: dict[str, int] = {}  # key -> the put that wrote our copy
        # Every remove up to this generation has reached us (`HeartbeatReply.mark`): a write of a
        # put up to it is one the master no longer expects (reclaimed), and is refused.
        self.mark = 0
        self._aborted: set[int] = set()  # puts above the mark whose removal came before their bytes
        self._open: dict[str, _Open] = {}
        # NodeWrite payloads being received into a reservation: id -> (put deadline, payload)
        self._filling: dict[int, tuple[float, Payload]] = {}
        self._lock = threading.Lock()
        self.credential: Any = None  # shown to the source node of a `copy` (the node principal)

    # ------------------------------------------------------------------ who wrote what

    def pending(self) -> set[str]:
        """Keys with an open reservation."""
        with self._lock:
            return set(self._open)

    def put_id_of(self, key: str) -> int:
        """The put that wrote our copy of `key`; 0 when unknown (held since before a restart)."""
        return self._put_ids.get(key, 0)

    def forget(self, key: str) -> int:
        """The store dropped `key`: forget its put (returned)."""
        with self._lock:
            return self._put_ids.pop(key, 0)

    def remove(self, key: str, put_id: int) -> bool:
        """Remove our copy of `key` if put `put_id` wrote it, or abort that put's open reservation
        (the master reclaimed it). A copy held since before a restart (put unknown, 0) is any
        put's; put id 0 names only such a copy (never a wildcard). When neither is here, the
        put's bytes may still be on their way: they will be refused (`stale`)."""
        if self.abort(key, put_id):
            return True
        with self._lock:
            ours = self._put_ids.get(key, 0) in (put_id, 0)
        try:
            removed = ours and self.store.remove(key)
        except KVPoolError:
            removed = False
        if not removed and put_id:
            with self._lock:
                if put_id > self.mark:
                    self._aborted.add(put_id)
        return removed

    def set_mark(self, mark: int) -> bool:
        """The master's new mark; True when it moved."""
        with self._lock:
            if mark <= self.mark:
                return False
            self.mark = mark
            self._aborted = {p for p in self._aborted if p > mark}
            return True

    def stale(self, put_id: int) -> bool:
        """Is a write of put `put_id` one the master gave up on (reclaimed, removed)?"""
        with self._lock:
            return put_id <= self.mark or put_id in self._aborted

    # ------------------------------------------------------------------ plan, reserve, publish

    def plan(self, key: str, size: int, put_id: int, ticket: bytes = b"") -> None:
        """Check that a write of `key` under `put_id` is one the master expects on this node.

        Put id 0 names no put: refused (`InvalidArgument`), embedded mode too, whose client
        starts and ends its puts at the master like any other (`kvpool.embedded`). A node whose
        master is in this process asks it; a node whose master is elsewhere checks the master's
        `ticket` (with a keyring: `tickets`), used once, and refuses (`Forbidden`) a write
        without a valid one, so no write lands here that the master did not admit under its
        tenant's pool-wide quota."""
        master = self.master
        if put_id == 0:
            raise InvalidArgument(f"write of {key!r} under no put (put id 0): start the put at the master first")
        if master is not None:
            if not master.expects_write(key, put_id, self.node_id):
                raise InvalidArgument(f"no pending put {put_id} of {key!r} on this node")
        elif self.tickets is not None:
            why = self.tickets.check(ticket, put_id, key, size, self.node_id)
            if why is None and not self._spent.take(put_id, key, ticket):
                why = "put ticket already used (a ticket admits one write)"
            if why is not None:
                log.info("node %s: refused a write of %r under put %d: %s", self.node_id, key, put_id, why)
                raise Forbidden(f"write of {key!r} under put {put_id} refused: {why}")
        if self.stale(put_id):
            raise Unavailable(f"put {put_id} of {key!r} was reclaimed by the master; start the put again")

    def reserve(self, key: str, size: int, put_id: int):
        if self.store.contains(key) and self._put_ids.get(key) != put_id:
            # The master planned a new put, so this copy is stale (its removal is still queued).
            self.store.remove(key)
        return self.store.reserve(key, size)

    def publish(self, key: str, put_id: int, offset: int, copy: bool = False) -> Placed:
        """Make the filled reservation of `key` visible (the writer's `PutEnd` publishes it at the
        master). A client's write (not a drain `copy`, which the master tracks itself) whose put
        the master gave up on meanwhile is refused: it would be a copy nobody knows of."""
        with self._lock:
            if not copy and (put_id <= self.mark or put_id in self._aborted):
                stale = True
            else:
                stale = False
                self._put_ids[key] = put_id
        if stale:
            self.store.abort(key)
            raise Unavailable(f"put {put_id} of {key!r} was reclaimed by the master; start the put again")
        self.store.commit(key)
        return Placed(self.node_id, "dram", self.segment, offset)

    # ------------------------------------------------------------------ bytes in the request / from a peer

    def write(self, key: str, size: int, put_id: int, payload: Payload, checked: bool = False,
              ticket: bytes = b"") -> Placed:
        """One object of a `NodeWrite`: its `size` bytes are next in `payload`. `checked`: the
        key was validated already (a tenant's, scoped at dispatch by `kvpool.security.authz`);
        `ticket`: the master's put ticket for this node (`plan`)."""
        try:
            if not checked:
                check_key(key)
            self.plan(key, size, put_id, ticket)
            res = self.reserve(key, size, put_id)
        except BaseException:
            payload.skip(size)
            raise
        token = id(payload)
        # No lock: one dict store / pop is atomic under the GIL, and `expire` snapshots the dict in one C call.
        self._filling[token] = (time.monotonic() + self.put_timeout_s, payload)
        try:
            payload.read_into(self.store.arena.buffer[res.offset:res.offset + size])
        except BaseException:
            self.store.abort(key)  # a half-written object is never visible
            raise
        finally:
            self._filling.pop(token, None)
        return self.publish(key, put_id, res.offset)

    def copy(self, keys: list[str], put_ids: list[int], source: str) -> list[Placed | Err]:
        """Pull `keys` from the node at `source` (one `NodeGet`) into this one."""
        peer = RpcClient(source, timeout=30.0, credential=self.credential)
        try:
            sizes = peer.call(NodeGet(list(keys))).sizes
            results: list[Placed | Err] = []
            for key, put_id, size in zip(keys, put_ids, sizes):
                if size < 0:
                    results.append(Err("not_found", f"{key!r} is not on {source}"))
                    continue
                try:
                    res = self.reserve(check_key(key), size, put_id)
                except KVPoolError as exc:
                    peer.skip_payload(size)
                    results.append(Err(exc.code, str(exc)))
                    continue
                try:
                    peer.read_payload_into(self.store.arena.buffer[res.offset:res.offset + size])
                except BaseException:
                    self.store.abort(key)
                    raise
                results.append(self.publish(key, put_id, res.offset, copy=True))
            return results
        finally:
            peer.close()

    # ------------------------------------------------------------------ the writer moves the bytes (transfer engine)

    def open(self, key: str, size: int, put_id: int, conn: Any, ticket: bytes = b"") -> Slot:
        """Reserve `key` for a writer that fills it through the transfer engine. `ticket`: as `write`."""
        check_key(key)
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise InvalidArgument(f"NodeReserve: size must be a positive integer, got {size!r}")
        self.plan(key, size, put_id, ticket)
        res = self.reserve(key, size, put_id)
        grant = b"" if self.sign is None else self.sign(WRITE, res.offset, size, self.put_timeout_s, _principal(conn))
        with self._lock:
            self._open[key] = _Open(put_id, res.offset, time.monotonic() + self.put_timeout_s, conn, grant)
        if conn is not None:
            conn.state.setdefault("writing", set()).add((key, put_id))
        return Slot(put_id, res.offset, grant)

    def commit(self, key: str, put_id: int, ok: bool, conn: Any) -> Placed | Err:
        """Publish (ok) or abort the open reservation of put `put_id` of `key`."""
        write = self._take(key, put_id)
        if conn is not None:
            conn.state.get("writing", set()).discard((key, put_id))
        if write is None:
            return Err(Unavailable.code, f"no reservation of put {put_id} of {key!r} "
                                         "(reclaimed, expired or never made)")
        if not ok:
            self._abort(key)
            return Err(Unavailable.code, f"put {put_id} of {key!r} aborted by its writer")
        try:
            return self.publish(key, write.put_id, write.offset)
        except KVPoolError as exc:
            return Err(exc.code, str(exc))

    def _take(self, key: str, put_id: int) -> _Open | None:
        with self._lock:
            write = self._open.get(key)
            if write is None or write.put_id != put_id:
                return None
            write = self._open.pop(key)
        if write.grant and self.revoke is not None:
            self.revoke(write.grant)  # committed or aborted: its writer may write no more
        return write

    def _abort(self, key: str) -> None:
        try:
            self.store.abort(key)
        except KVPoolError:
            log.debug("abort of %r: no reservation", key)

    def abort(self, key: str, put_id: int) -> bool:
        """Abort the open reservation of put `put_id` of `key`, if there is one."""
        write = self._take(key, put_id)
        if write is None:
            return False
        self._abort(key)
        return True

    def expire(self) -> None:
        self._spent.sweep()
        now = time.monotonic()
        with self._lock:
            stale = [(k, w.put_id) for k, w in self._open.items() if w.deadline <= now]
            late = [p for deadline, p in list(self._filling.values()) if deadline <= now]
        for payload in late:
            # Its thread is blocked receiving into the reservation: cutting the socket wakes it,
            # and it aborts the reservation itself (nothing else may free a range being written).
            log.info("node %s: a NodeWrite payload still arriving at its put deadline (%.3gs); closing its connection",
                     self.node_id, self.put_timeout_s)
            payload.cut()
        for key, put_id in stale:
            if self.abort(key, put_id):
                log.info("node %s: reservation of %r (put %d) expired without a commit", self.node_id, key, put_id)

    def conn_closed(self, conn: Any) -> None:
        """The writer's connection closed: its open reservations will never be committed."""
        for key, put_id in list(conn.state.get("writing", ())):
            with self._lock:
                write = self._open.get(key)
                mine = write is not None and write.put_id == put_id and write.conn is conn
            if mine:
                self.abort(key, put_id)


def check_sizes(sizes: list[int], payload: Payload, what: str) -> None:
    """`InvalidArgument` unless every size is a positive int and they add up to the payload."""
    total = 0
    for size in sizes:  # a loop, not any() + sum(): a single put is the common case
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            total = -1
            break
        total += size
    if total != payload.length:
        raise InvalidArgument(f"{what}: sizes must be positive and add up to the payload ({payload.length})")


def _principal(conn: Any) -> str:
    """The name the writer's connection proved (its grants name it); "" for an in-process caller."""
    principal = getattr(conn, "principal", None)
    return principal.name if principal is not None else ""
