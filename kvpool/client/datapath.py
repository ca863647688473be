"""How bytes move between this client and a store node: the client's paths for the routes.

The client asks *where* first (`kvpool.client.where`), then hands each node's share of a call to
that node's path. `DataPaths.choose` does not decide the route: `transfer.route.route` does, from
the node's published host id and what it offers (its arena mapped here: shm; its transfer
segment with rdma: rdma; its RPC: tcp), and the client maps the answer to a path:
- `shm` (node on this host, its arena mapped read-only): a read looks each key up in the node's
  shm DRAM index and copies it out of the mapping, validated after the copy: no round trip.
  Index misses (SSD, just changed, no slot) cost one `NodePin` + a copy + an unpin riding on the
  next request (up to 32 KiB, and unpinnable SSD reads, come inline). Writes as `rpc`, over the
  node's unix socket.
- `rpc` (tcp: another host, or `use_shm=False`): one `NodeGet` whose payload is received straight
  into the caller's buffer, sent to the node's read port when it has one (`kvpool.node.readers`:
  several processes serve it; a miss there is `ABSENT`, and -1, "not here", is asked of the node's
  RPC next);
  one `NodeWrite` the node receives straight into its arena (to an embedded pool: one `Put`, its
  master's `PutStart` and `PutEnd` in the same frame).
- `engine` (rdma, in "auto" mode; any route with `data_path="engine"`, whose engine then takes
  the route itself per op): `kvpool.client.engine_path`.

Why each stays (kvpool bench pool, 2026-11-29 run on this 2-core machine): `shm` puts same-host
gets 12-51x ahead of Redis over its unix socket (and comes before rdma on the route); `rpc` is
one round trip where the engine needs two (pin, READ) or three (reserve, WRITE, commit), and
over TCP the engine path moved 0.25-0.79x of `rpc`'s GB/s for gets and 0.23-0.67x for puts (even
only for batches of 1 MiB values, 1.09x), so "auto" keeps TCP peers on `rpc`; `engine` is the
only one-sided path, the one RDMA takes.

A path's `read(work, keys, views, out, tiers=None)` fills out[i] for each (node, indexes) of
`work` (bytes when `views` is None, else the size copied into views[i], or `TOO_SMALL`; misses
stay), and tiers[i] with the tier that served a hit ("dram" | "ssd") when `tiers` is a list; it
returns (indexes to retry on another replica, addresses of nodes that are gone); `write(work,
keys, put_ids, views, replicas, tickets)` (tickets[i]: node address -> the master's put ticket of
key i, or None) returns {(address, i): `Placed` | `EXISTS` | a `KVPoolError`},
every node's request sent before any reply is awaited.
"""

from __future__ import annotations

from typing import Any, Sequence

from kvpool.client.engine_path import EnginePath
from kvpool.client.nodes import TOO_SMALL, NodeConn, fan_out, mark_tiers, node_tickets, written
from kvpool.errors import InvalidArgument, KVPoolError, Unavailable
from kvpool.messages import ABSENT, NodeGet, NodePin, NodeWrite, Put
from kvpool.rpc import RpcClient
from transfer.route import route

DATA_PATHS = ("auto", "rpc", "engine")
BATCH_SLURP_MAX = 256 * 1024  # a batch reply up to this size is received in one piece

Work = Sequence[tuple[NodeConn, list[int]]]

_ASK_NODE = object()  # a read port's "not here": the node answers next


class RpcPath:
    """Bytes ride on the node's RPC connection."""

    name = "rpc"

    def read(self, work: Work, keys: Sequence[str], views: Sequence[memoryview] | None,
             out: list, tiers: list | None = None) -> tuple[list[int], list[str]]:
        retry: list[int] = []
        dead: list[str] = []
        whole = len(work) == 1 and work[0][1] == list(range(len(keys)))  # one node, every key in order
        for conn, idx in work:
            try:
                if whole:
                    self._read(conn, keys, views, idx, out, tiers)
                else:
                    self._read(conn, [keys[i] for i in idx], None if views is None else [views[i] for i in idx], idx,
                               out, tiers)
            except Unavailable:  # that node is gone: try the next replica
                retry.extend(idx)
                dead.append(conn.address)
        return retry, dead

    def _read(self, conn: NodeConn, keys: list[str], views: list[memoryview] | None, idx: list[int],
              out: list, tiers: list | None) -> None:
        reader = conn.reader
        if reader is not None:
            try:
                left = self._get(reader, keys, views, idx, out, tiers)
            except KVPoolError as exc:  # a worker died, or the port refused us: the node answers
                conn.reader_failed(exc)
            else:
                if not left:
                    return
                if len(left) < len(keys):
                    keys, idx = [keys[j] for j in left], [idx[j] for j in left]
                    views = None if views is None else [views[j] for j in left]
        self._get(conn.rpc, keys, views, idx, out, tiers)

    def get_one(self, conn: NodeConn, key: str, view: memoryview | None) -> bytes | int | None:
        """One key, as `_read` reads it without its lists (the embedded single get): the bytes
        (`view` None), else the size (copied into `view` when it fits, else `TOO_SMALL`); None: a
        miss. `Unavailable`: the node is gone."""
        reader = conn.reader
        if reader is not None:
            try:
                got = _get_one(reader, key, view, ABSENT)
            except KVPoolError as exc:
                conn.reader_failed(exc)
            else:
                if got is not _ASK_NODE:
                    return got
        return _get_one(conn.rpc, key, view)

    @staticmethod
    def _get(rpc: RpcClient, keys: list[str], views: list[memoryview] | None, idx: list[int],
             out: list, tiers: list | None) -> list[int]:
        """One `NodeGet` on `rpc`: fills the hits; the positions (in `keys`) it answered -1."""
        data = rpc.call(NodeGet(keys))
        cur = _Cursor(rpc, len(data.sizes))
        missed = []
        for j, (i, n) in enumerate(zip(idx, data.sizes)):
            if n >= 0:
                out[i] = cur.deliver(n, None if views is None else views[j])
            elif n == -1:  # from a read port: not there, ask the node (ABSENT: the node has none)
                missed.append(j)
        if tiers is not None:
            mark_tiers(tiers, idx, data.sizes, data.ssd)
        return missed

    def write(self, work: Work, keys: Sequence[str], put_ids: Sequence[int], views: Sequence[memoryview],
              replicas: int = 0, tickets: Sequence[dict[str, bytes] | None] | None = None
              ) -> dict[tuple[str, int], Any]:
        result: dict[tuple[str, int], Any] = {}

        def request(conn: NodeConn, idx: list[int]) -> tuple[NodeWrite, Sequence[Any]]:
            if tickets is None and len(idx) == len(keys) == 1:  # the common single put: no sub-lists
                return NodeWrite(list(keys), [views[0].nbytes], list(put_ids), replicas), views
            return (NodeWrite([keys[i] for i in idx], [views[i].nbytes for i in idx], [put_ids[i] for i in idx],
                              replicas, node_tickets(tickets, conn, idx)), [views[i] for i in idx])

        for conn, idx, reply in fan_out(work, request):
            if isinstance(reply, KVPoolError):
                result.update(((conn.address, i), reply) for i in idx)
                continue
            for i, res in zip(idx, reply.results):
                result[(conn.address, i)] = written(res)
        return result

    def put(self, conn: NodeConn, keys: list[str], views: list[memoryview], replicas: int,
            token: int) -> list[Any]:
        """To an embedded pool (the node is the master's own server): `Put`, its master's
        `PutStart`, the write and `PutEnd` in one round trip. One entry per key: `Placed` (and
        published) | `EXISTS` | a `KVPoolError`."""
        msg = Put(keys, [v.nbytes for v in views], replicas, token)
        try:
            conn.rpc.send_request(msg, views)
            reply = conn.rpc.recv_reply()
        except KVPoolError as exc:
            return [exc] * len(keys)
        return [written(res) for res in reply.results]


def _get_one(rpc: RpcClient, key: str, view: memoryview | None, absent: int = -1) -> Any:
    """As `RpcPath.get_one` on one port, whose miss is `absent` (on a read port, -1 means "ask the
    node": `_ASK_NODE`)."""
    n = rpc.call(NodeGet([key])).sizes[0]
    if n < 0:
        return None if n == absent else _ASK_NODE
    if view is None:
        return rpc.read_payload(n)
    if n > len(view):
        rpc.skip_payload(n)
        return TOO_SMALL
    rpc.read_payload_into(view[:n])
    return n


class ShmPath(RpcPath):
    """Reads copy out of the node's arena mapped on this host; writes as `RpcPath`."""

    name = "shm"

    def _read(self, conn: NodeConn, keys: list[str], views: list[memoryview] | None, idx: list[int],
              out: list, tiers: list | None) -> None:
        todo = range(len(keys)) if conn.index is None else self._from_index(conn, keys, views, idx, out, tiers)
        if not todo:
            return
        pins = conn.rpc.call(NodePin([keys[j] for j in todo], conn.take_unpins()))
        if tiers is not None:
            mark_tiers(tiers, [idx[j] for j in todo], pins.sizes, pins.ssd)
        arena = conn.arena
        cur = _Cursor(conn.rpc, sum(1 for o in pins.offsets if o < 0))
        try:
            for j, offset, n in zip(todo, pins.offsets, pins.sizes):
                if n < 0:
                    continue
                view = None if views is None else views[j]
                if offset < 0:  # inline in the reply
                    out[idx[j]] = cur.deliver(n, view)
                elif view is None:
                    out[idx[j]] = bytes(arena[offset:offset + n])
                elif n > len(view):
                    out[idx[j]] = TOO_SMALL
                else:
                    view[:n] = arena[offset:offset + n]
                    out[idx[j]] = n
        finally:
            conn.unpin_later(pins.pin_id)

    @staticmethod
    def _from_index(conn: NodeConn, keys: list[str], views: list[memoryview] | None, idx: list[int],
                    out: list, tiers: list | None) -> list[int]:
        """Serve what the shm index can; the positions (in `keys`) left for the node."""
        index, arena = conn.index, conn.arena
        todo: list[int] = []
        served: list[str] = []
        scope = conn.scope  # the index holds keys as stored (a tenant's are scoped)
        for j, key in enumerate(keys):
            view = None if views is None else views[j]
            value = index.read(scope + key if scope else key, arena, view)
            if value is None:
                todo.append(j)
                continue
            if view is not None and value > len(view):
                value = TOO_SMALL
            out[idx[j]] = value
            if value is not TOO_SMALL:
                served.append(key)
                if tiers is not None:  # the shm index holds DRAM objects only
                    tiers[idx[j]] = "dram"
        if served:
            conn.served_from_index(served)
        return todo


class DataPaths:
    """Chooses each node's path. `mode`: one of DATA_PATHS; `engine`: a started TransferEngine
    (the caller owns it), else one is opened on first need with `transports`."""

    def __init__(self, mode: str = "auto", engine: Any = None, transports: Sequence[str] | None = None,
                 timeout: float = 10.0):
        if mode not in DATA_PATHS:
            raise InvalidArgument(f"data_path must be one of {list(DATA_PATHS)}, got {mode!r}")
        self.mode = mode
        self.rpc, self.shm = RpcPath(), ShmPath()
        self.engine = EnginePath(mode == "auto", engine, transports, timeout)

    def choose(self, conn: NodeConn) -> RpcPath | EnginePath:
        """The node's path, kept on it (`conn.path`) until what it offers changes."""
        desc = None if self.mode == "rpc" else conn.transfer_segment()
        if desc is not None and self.mode == "engine":
            conn.path = self.engine
            return conn.path
        offers = ["tcp"]
        if conn.shm:
            offers.append("shm")
        if desc is not None and "rdma" in desc.transports:
            offers.append("rdma")
        ours = ("shm", "tcp", "rdma") if "rdma" in offers and self.engine.has_rdma() else ("shm", "tcp")
        way = route(conn.host_id, offers, ours)
        conn.path = self.shm if way == "shm" else self.engine if way == "rdma" else self.rpc
        return conn.path

    def close(self) -> None:
        self.engine.close()


class _Cursor:
    """Hands out a reply payload piece by piece. Several small pieces are received with one
    `recv` and sliced (a syscall per 4 KiB object costs more than copying it); large ones go
    straight from the socket into their destination."""

    def __init__(self, rpc: RpcClient, pieces: int):
        self.rpc = rpc
        self.blob: memoryview | None = None
        self.pos = 0
        if pieces > 1 and 0 < rpc.payload_left <= BATCH_SLURP_MAX:
            self.blob = memoryview(rpc.read_payload(rpc.payload_left))

    def deliver(self, n: int, view: memoryview | None) -> Any:
        """The next n bytes: as `bytes` (no view), copied into `view` (its size), or skipped
        (TOO_SMALL) when `view` cannot hold them."""
        blob = self.blob
        if view is not None and n > len(view):
            if blob is None:
                self.rpc.skip_payload(n)
            self.pos += n
            return TOO_SMALL
        if blob is None:
            if view is None:
                return self.rpc.read_payload(n)
            self.rpc.read_payload_into(view[:n])
            return n
        self.pos += n
        if view is None:
            return bytes(blob[self.pos - n:self.pos])
        view[:n] = blob[self.pos - n:self.pos]
        return n
