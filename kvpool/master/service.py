"""`MasterService`: the pool's metadata service, in process. Synchronous and thread-safe.

Every public method is a plain synchronous call guarded by the state's one lock; none of them
waits on the network while holding it (`kvpool.master.state`).

Roles: in embedded mode the master is always the leader. In cluster mode `kvpool.cluster` calls
`become_leader` / `become_standby`; a standby raises `NotLeader` from client and node calls, and
a new leader answers `Unavailable` ("recovering") for keys it does not know yet until every node
registered in etcd has re-reported what it holds (or `recovery_s` passes), so a failover never
turns a complete object into a miss.

This file holds the client- and node-facing calls. Its helpers are given the shared
`MasterState`: `admin` (`AdminOps`, what the admin API calls), `housekeeping` (reclaim, node
timeouts, eviction, the outbox thread) and `migration` (draining).

Errors: malformed input raises `InvalidArgument` (or `ObjectTooLarge`); an unknown node id or key
in admin calls raises `KeyNotFound`; no room raises `CapacityError` / `AllPinned`; a put past its
tenant's pool-wide quota raises `QuotaExceeded` (`kvpool.master.quotas`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterable, Sequence

from kvpool.config import Settings, load_settings
from kvpool.contract import check_stored_key as check_key
from kvpool.errors import AlreadyExists, CapacityError, InvalidArgument, ObjectTooLarge, Unavailable
from kvpool.master.admin_ops import AdminOps
from kvpool.master.housekeeping import Housekeeping
from kvpool.master.migration import Migration
from kvpool.master.nodes import MAX_OBJECT_BYTES
from kvpool.master.placement import choose_nodes
from kvpool.master.state import MasterState
from kvpool.master.tables import COMPLETE, PENDING, NodeEntry
from kvpool.messages import Entry, Held, Location, NodeInfo, Placed, PutPlan, Target

log = logging.getLogger(__name__)


class MasterService:
    """Object table + node table + placement + leases; reclaim and eviction by `housekeeping`.

    `link_factory(node: NodeEntry)`: how to reach a node (see `MasterState`).
    """

    def __init__(self, settings: Settings | None = None, *, link_factory: Callable[[NodeEntry], Any] | None = None,
                 address: str = ""):
        self.state = MasterState(settings or load_settings(), link_factory, address)
        self.unix_address: str | None = None  # the RPC server's unix socket, told to clients in hello
        self.migration = Migration(self.state)
        self.housekeeping = Housekeeping(self.state, self.migration)
        self.admin = AdminOps(self.state, self.migration)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def replicas(self) -> int:
        return self.state.tunables.replicas

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "MasterService":
        hk = self.housekeeping
        for target, name in ((lambda: hk.tick_loop(self._stop), "master-tick"),
                             (hk.outbox_loop, "master-outbox")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        st = self.state
        self._stop.set()
        st.outbox.stop()
        for t in self._threads:
            t.join(timeout=5)
        with st.lock:
            links = st.links.take_all()
        for link in links:
            try:
                link.close()
            except Exception:  # closing a dead link must not stop shutdown
                log.debug("closing node link failed", exc_info=True)

    @property
    def leader(self) -> bool:
        return self.state.role.leader

    def become_leader(self, expected_nodes: Iterable[str] = (), removed: Iterable[tuple[str, int]] = (),
                      horizon: int = 0, floor: int = 0) -> None:
        """Take over: start from empty tables and wait for `expected_nodes` to re-report.
        From etcd (`kvpool.cluster.removals.RemovalLog`): `removed`, the (key, generation)
        tombstones earlier leaders left, and their `horizon`; `floor`, the first generation this
        term may issue (ids only grow across leaders)."""
        st = self.state
        removed = list(removed)
        with st.lock:
            st.clear_tables_locked()
            st.tombstones.restore(removed, horizon, time.monotonic())
            for _, generation in removed:
                st.ids.observe(generation)
            st.ids.observe(max(horizon, floor))
            waiting = st.role.lead(expected_nodes, st.tunables.recovery_s, time.monotonic())
        log.info("master %s is the leader; waiting for %d node(s) to re-report", st.role.address, waiting)

    def become_standby(self, leader_address: str | None) -> None:
        st = self.state
        with st.lock:
            st.role.stand_by(leader_address)
            st.clear_tables_locked()

    # ------------------------------------------------------------------ node-facing

    def register_node(self, info: NodeInfo, objects: Sequence[Held] = (), mark: int = 0) -> None:
        """A node (re-)joins and reports everything it holds; the table is reconciled with it
        (`MasterState.reconcile_locked`); the copies it must not keep are removed from it."""
        st = self.state
        st.role.check_leader()
        now = time.monotonic()
        with st.lock:
            node, moved = st.nodes.join(info, now, st.tunables.node_timeout_s)
            if moved:  # restarted elsewhere: the old connection is useless
                link = st.links.pop(node.node_id)
                if link is not None:
                    st.outbox.close(link)
            stale_keys, stale_ids = st.reconcile_locked(node, objects, mark)
            if stale_keys:
                st.outbox.remove(node.node_id, stale_keys, stale_ids)
            st.role.reported(info.node_id)
        log.info("node %s registered at %s with %d object(s)%s", info.node_id, info.address, len(objects),
                 f", {len(stale_keys)} refused" if stale_keys else "")

    def heartbeat(self, node_id: str, stats: dict | None = None, dropped: Sequence[Held] = (),
                  moved: Sequence[Held] = ()) -> tuple[bool, int]:
        """Record liveness and what the node's own eviction did. Returns (known, mark): known
        False: register again (unknown, or a removal failed to reach it); `mark`: the node's
        mark (`MasterState.grant_mark_locked`)."""
        st = self.state
        st.role.check_leader()
        with st.lock:
            node = st.nodes.heard(node_id, time.monotonic(), stats)
            if node is None:
                return False, 0
            for held in dropped:
                st.drop_replica_locked(held.key, node_id, held.put_id)
            for held in moved:
                st.objects.retier(held.key, node_id, held.tier)
            if st.nodes.is_dirty(node_id):
                return False, node.mark
            return True, st.grant_mark_locked(node)

    def drop_node(self, node_id: str, reason: str = "lease ended") -> bool:
        """Forget a node and every replica on it (called when its lease or heartbeat ends)."""
        with self.state.lock:
            return self.state.drop_node_locked(node_id, reason)

    def mark_local(self, node_id: str) -> None:
        """The node runs in this process (embedded): its liveness is ours, never time it out."""
        with self.state.lock:
            self.state.nodes.local.add(node_id)

    def node_addresses(self) -> set[str]:
        with self.state.lock:
            return self.state.nodes.addresses()

    def known_nodes(self) -> list[str]:
        with self.state.lock:
            return self.state.nodes.ids()

    # ------------------------------------------------------------------ client-facing

    def put_start(self, key: str, size: int, replicas: int | None = None, writer_node: str = "",
                  token: int = 0) -> PutPlan:
        """Plan a put: choose nodes and record a pending object. `exists=True`: already complete.
        With a keyring each target comes with its put ticket (`kvpool.security.tickets`), signed
        once the put is admitted under its tenant's quota: the nodes take no write without it.

        `token` (not 0): the writer's id of this put. A pending put of `key` with the same token
        is this put's earlier attempt, whose writer gave up on it (a lost reply or connection,
        found by issue 14's chaos runs): it is reclaimed and the put planned anew, so a retry
        never fails on itself. Any other pending put of `key` raises `AlreadyExists`."""
        st = self.state
        st.role.check_leader()
        check_key(key)
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise InvalidArgument(f"value size must be a positive integer, got {size!r}")
        tun = st.tunables
        want = tun.replicas if not replicas else replicas
        if not isinstance(want, int) or want < 1:
            raise InvalidArgument(f"replicas must be >= 1, got {replicas!r}")
        now = time.monotonic()
        with st.lock:
            nodes = st.nodes
            limit = nodes.max_object()
            if size > limit:
                raise ObjectTooLarge(f"value of {size} bytes is larger than the largest object a node can hold "
                                     f"({limit} bytes)")
            obj = st.objects.get(key)
            if obj is not None:
                if obj.state == COMPLETE and not obj.removing:
                    return PutPlan(put_id=0, targets=[], exists=True)
                if obj.state == PENDING and obj.deadline > now and (not token or obj.token != token):
                    raise AlreadyExists(f"key {key!r} is being written by another put")
                if obj.removing:
                    raise AlreadyExists(f"key {key!r} is being removed (a reader holds a lease); retry later")
                st.reclaim_locked(obj)
            st.quotas.check(st.objects, key, size, 1)  # before making room: nobody is evicted for a refused put
            chosen = choose_nodes(nodes.values(), size, want, writer_node)
            if not chosen:
                self.housekeeping.make_room_locked(size, now)
                chosen = choose_nodes(nodes.values(), size, want, writer_node)
            if not chosen:
                raise CapacityError(f"no store node has room for {size} bytes "
                                    f"({len(nodes)} node(s) registered)")
            if len(chosen) < want:
                log.warning("put %r: %d replica(s) requested, only %d node(s) can take it", key, want, len(chosen))
            st.quotas.check(st.objects, key, size, len(chosen))
            put_id = next(st.ids)
            st.objects.plan(key, size, chosen, put_id, now + tun.put_timeout_s, token)
            tickets = st.tickets
            if tickets is None:
                return PutPlan(put_id=put_id, targets=[Target(n.node_id, n.address) for n in chosen])
            # a node in another process takes the write only with the ticket (a node here asks us)
            return PutPlan(put_id=put_id, targets=[
                Target(n.node_id, n.address, b"" if n.node_id in nodes.local else
                       tickets.sign(put_id, key, size, n.node_id, tun.put_timeout_s)) for n in chosen])

    def put_end(self, key: str, put_id: int, written: Sequence[Placed]) -> None:
        """Publish a put with the replicas that landed; no replica landed = abort."""
        st = self.state
        st.role.check_leader()
        with st.lock:
            obj = st.objects.get(key)
            if obj is not None and obj.state == COMPLETE and obj.put_id == put_id:
                return  # already published (a new leader learned it from the nodes' reports)
            if obj is None or obj.state != PENDING or obj.put_id != put_id:
                for p in written:  # the put was reclaimed or removed meanwhile: its bytes must go
                    st.outbox.remove(p.node_id, [key], [put_id])
                raise Unavailable(f"put of {key!r} was reclaimed or removed before it ended; retry it")
            # A copy the table does not take (its node left and came back, or a write still on its
            # way to a node that missed the put) must not linger unknown: the node remembers the
            # put as aborted (`kvpool.node.writes`).
            published, gone = st.objects.publish(obj, written, time.monotonic())
            for node_id in gone:
                st.outbox.remove(node_id, [key], [put_id])
            if not published:
                raise Unavailable(f"put of {key!r}: no replica was written")
            st.counters["puts"] += 1
            st.counters["put_bytes"] += obj.size

    def expects_write(self, key: str, put_id: int, node_id: str) -> bool:
        """Is `node_id` a target of the pending put `put_id` of `key`? (nodes refuse stray writes)"""
        with self.state.lock:
            obj = self.state.objects.get(key)
            return obj is not None and obj.state == PENDING and obj.put_id == put_id and node_id in obj.replicas

    def lookup(self, keys: Sequence[str], lease: bool = True,
               release: Sequence[int] = ()) -> tuple[int, list[Entry | None]]:
        """Replicas of each complete key (None: a miss) and one lease id covering the hits."""
        st = self.state
        st.role.check_leader()
        now = time.monotonic()
        out: list[Entry | None] = []
        with st.lock:
            if release:
                st.release_locked(release, now)
            lease_id = next(st.ids) if lease else 0
            get, node_of, counters = st.objects.get, st.nodes.get, st.counters
            leased = []
            for key in keys:
                obj = get(key)
                if obj is None or not obj.visible():
                    if obj is None and st.role.recovering(now):
                        raise Unavailable("master is recovering after a failover; retry shortly")
                    out.append(None)
                    counters["misses"] += 1
                    continue
                locs = [Location(r.node_id, n.address, r.tier, r.offset)
                        for r in obj.replicas.values() if (n := node_of(r.node_id)) is not None]
                obj.last_access = now
                if lease:
                    leased.append(obj)
                out.append(Entry(obj.size, locs))
                counters["hits"] += 1
            counters["gets"] += len(keys)
            if leased:
                st.leases.grant(lease_id, leased, now + st.tunables.lease_s)
            else:
                lease_id = 0
        return lease_id, out

    def owned_leases(self, lease_ids: Sequence[int], prefix: str) -> list[int]:
        """The leases among `lease_ids` that cover only keys under `prefix` (a tenant's scope):
        lease ids are sequential, so a tenant must not end another tenant's leases."""
        with self.state.lock:
            return self.state.leases.owned(lease_ids, prefix)

    def release(self, lease_ids: Sequence[int]) -> None:
        """The reader is done: leases end, deferred removals finish."""
        with self.state.lock:
            self.state.release_locked(lease_ids, time.monotonic())

    def touch(self, key: str) -> bool:
        """Embedded fast path: visible? and count the access (no lease: the node pins while it reads)."""
        st = self.state
        with st.lock:
            obj = st.objects.visible(key)
            if obj is None:
                st.counters["misses"] += 1
                return False
            obj.last_access = time.monotonic()
            st.counters["hits"] += 1
            return True

    def exists(self, keys: Sequence[str]) -> list[bool]:
        st = self.state
        st.role.check_leader()
        with st.lock:
            objects = st.objects
            if st.role.recovering(time.monotonic()) and any(k not in objects for k in keys):
                raise Unavailable("master is recovering after a failover; retry shortly")
            get = objects.get
            return [(o := get(k)) is not None and o.visible() for k in keys]

    def match_prefix(self, keys: Sequence[str]) -> int:
        """n such that keys[0..n) are all complete and keys[n] is not."""
        st = self.state
        st.role.check_leader()
        with st.lock:
            recovering = st.role.recovering(time.monotonic())
            get = st.objects.get
            for i, key in enumerate(keys):
                obj = get(key)
                if obj is None or not obj.visible():
                    if recovering:
                        raise Unavailable("master is recovering after a failover; retry shortly")
                    return i
            return len(keys)

    def remove(self, keys: Sequence[str]) -> list[bool]:
        """Remove objects; a leased one disappears for readers now and is freed when its leases end.
        True: removed; False: not found (or being removed already).

        Never undone, found or not: the remove takes a generation T and leaves a tombstone for
        each key (in cluster mode written to etcd first, outside the lock), so a node's copy
        written before it (put id <= T), reported later to this master or the next leader, is
        refused (`kvpool.master.tombstones`). A put that began after T is not removed by it."""
        st = self.state
        st.role.check_leader()
        out = []
        now = time.monotonic()
        log_ = st.removal_log
        with st.lock:
            # A key this new leader does not know yet may be on a node still to re-report: "not
            # found" now would leave the object to come back with that report (found by chaos).
            if st.role.recovering(now) and any(k not in st.objects for k in keys):
                raise Unavailable("master is recovering after a failover; retry shortly")
            # The pool in one process (embedded): its node never re-reports, no tombstone needed.
            tombstones = not st.nodes.all_local()
            generation = next(st.ids)
            if tombstones and log_ is not None:
                st.tombstones.recording.add(generation)
        if tombstones and log_ is not None:
            try:
                log_.record(keys, generation)  # Unavailable when etcd cannot take it: nothing was removed
            finally:
                with st.lock:
                    st.tombstones.recording.discard(generation)
        with st.lock:
            for key in keys:
                if tombstones:
                    st.tombstones.remember(key, generation, now)
                obj = st.objects.get(key)
                if obj is None or obj.removing or obj.put_id > generation:
                    out.append(False)
                    continue
                if obj.state == PENDING:
                    st.reclaim_locked(obj)
                elif obj.leased(now):
                    st.objects.start_removing(obj)
                    for node_id in obj.replicas:
                        st.hide_local_locked(node_id, obj)
                else:
                    st.delete_locked(obj)
                st.counters["removes"] += 1
                out.append(True)
        return out

    def max_object_bytes(self) -> int:
        with self.state.lock:
            try:
                return self.state.nodes.max_object()
            except Unavailable:
                return MAX_OBJECT_BYTES
