"""A client's connection to one store node: its RPC connection and, on the same host (the
node's published host id, `transfer.route.same_host`), its arena and DRAM index mapped
read-only (`kvpool.shm.index`) and its RPC over its unix socket.

What the connection keeps between calls: pins to release (`unpin_later`: they ride on the next
request to that node, or a one-way `NodeUnpin` from `flush`, so an unpin costs no round trip),
reads served from the shm index, to report in batches (`NodeUnpin.touched`: hits and eviction
recency stay right), the node's transfer segment (learned from the embedded pool's hello, a
`NodeStats` answer or a `Slots` reply), and a connection to its read port when it has one
(`kvpool.node.readers`: learned with the segment; after a failure there, none for `READER_RETRY_S`).
How bytes move is `kvpool.client.datapath`.

Not thread-safe: the owning client serializes calls.
"""

from __future__ import annotations

import logging
import mmap
import time
from typing import Any, Callable, Sequence

from kvpool.security.keyring import Credential
from kvpool.config import Settings, current_settings
from kvpool.errors import InvalidArgument, KVPoolError, Unavailable, error_from_code
from kvpool.messages import Err, NodePin, NodeStats, NodeUnpin
from kvpool.rpc import RpcClient
from kvpool.shm import index as shm_index
from kvpool.shm.arena import map_read_only, populate
from transfer.route import same_host

log = logging.getLogger(__name__)

MAX_PENDING_UNPINS = 256
MAX_PENDING_TOUCHES = 64  # index reads reported to the node per one-way message
POPULATE_MAX = 16 << 30  # map a node's arena into our page tables up front up to this size
_UNKNOWN = object()  # transfer segment not learned yet
READER_RETRY_S = 5.0  # after the read port failed, gets go to the node's RPC this long
TOO_SMALL = -2  # a read result: the caller's buffer cannot hold the object
EXISTS = "exists"  # a write result: the key was already complete, nothing was written


def node_tickets(tickets: Sequence[dict[str, bytes] | None] | None, conn: "NodeConn", idx: list[int]) -> list[bytes]:
    """The put tickets of keys `idx` for the node on `conn` (`NodeWrite.tickets`); [] without any."""
    if tickets is None:
        return []
    return [(tickets[i] or {}).get(conn.address, b"") for i in idx]


def mark_tiers(tiers: list, idx: Sequence[int], sizes: Sequence[int], ssd: Sequence[int]) -> None:
    """tiers[idx[j]] = the tier a node's reply says served position j (hits only)."""
    from_ssd = set(ssd)
    for j, (i, n) in enumerate(zip(idx, sizes)):
        if n >= 0:
            tiers[i] = "ssd" if j in from_ssd else "dram"


def written(res: Any) -> Any:
    """A write's result as the client keeps it: `Placed`, `EXISTS` or a `KVPoolError`."""
    if isinstance(res, Err):
        return error_from_code(res.code, res.message)
    return EXISTS if res.offset < 0 and not res.tier else res  # already complete: nothing written


class NodeConn:
    def __init__(self, address: str, rpc: RpcClient | None = None, *, timeout: float = 10.0, use_shm: bool = True,
                 shm_path: str | None = None, host_id: str = "", arena_size: int | None = None,
                 segment: bytes | None = None, index_path: str | None = None, settings: Settings | None = None,
                 credential: Credential | None = None, scope: str = "", read_address: str | None = None):
        """`scope`: the prefix the pool stores our keys under (a tenant's), for reads from the shm
        index; the node scopes the keys of our requests itself. `host_id`: the node's host, as
        it published it (learned from `NodeStats` when `shm_path` is not given). `read_address`:
        its read port, as the hello told (else learned from `NodeStats` with the segment)."""
        self.address = address
        self.host_id = host_id
        self.scope = scope
        self.rpc = rpc or RpcClient(address, timeout=timeout, settings=settings, credential=credential)
        self.unpins: list[int] = []
        self.touched: list[str] = []
        self._mmap: mmap.mmap | None = None
        self.arena: memoryview | None = None
        self.index: shm_index.ShmIndexReader | None = None
        self._segment: Any = _UNKNOWN
        self.path: Any = None  # the data path chosen for this node (`kvpool.client.datapath`)
        self.read_address = read_address
        self._reader: RpcClient | None = None
        self._reader_retry_at = 0.0
        self._settings = settings
        if segment is not None or shm_path is not None:  # the hello told us
            self.remember_segment(segment)
        if use_shm:
            if shm_path is None:
                info = self.rpc.call(NodeStats()).doc
                shm_path, arena_size = info.get("shm_path"), info.get("arena_size")
                self.host_id, index_path = info.get("host_id") or "", info.get("index_path")
                self._learn(info)
                if same_host(self.host_id):
                    self.rpc.use_unix(info.get("unix"))  # the node's unix socket
            self._map(shm_path, arena_size)
            use_index = shm_index.supported() and (settings or current_settings()).rpc.shm_index
            if self.arena is not None and index_path and use_index:
                try:
                    self.index = shm_index.ShmIndexReader(index_path)
                except (OSError, InvalidArgument) as exc:
                    log.info("node %s: not using its shm index %s (%s)", self.address, index_path, exc)

    def transfer_segment(self):
        """The node's arena as a `transfer.SegmentDescriptor`, or None when it has no engine."""
        if self._segment is _UNKNOWN:
            self._learn(self.rpc.call(NodeStats()).doc)
        return self._segment

    def _learn(self, info: dict) -> None:
        self.read_address = info.get("read_address")
        self.remember_segment(info.get("transfer_segment"))

    @property
    def reader(self) -> RpcClient | None:
        """The connection to the node's read port (opened on first use), or None: use its RPC."""
        if self._reader is None and self.read_address and time.monotonic() >= self._reader_retry_at:
            self._reader = RpcClient(self.read_address, timeout=self.rpc.timeout, settings=self._settings,
                                     credential=self.rpc.credential)
        return self._reader

    def reader_failed(self, why: Exception) -> None:
        """The read port failed a get (its worker died, or it refused us): the node's RPC serves
        gets for a while."""
        log.info("node %s: read port %s failed (%s); reading through the node for %.3gs", self.address,
                 self.read_address, why, READER_RETRY_S)
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        self._reader_retry_at = time.monotonic() + READER_RETRY_S

    def remember_segment(self, raw: bytes | None) -> None:
        self.path = None  # choose again
        if raw is None:
            self._segment = None
            return
        from transfer import SegmentDescriptor, TransferError

        try:
            self._segment = SegmentDescriptor.from_bytes(raw)
        except TransferError as exc:
            log.warning("node %s published an unreadable transfer segment (%s); using its RPC", self.address, exc)
            self._segment = None

    def _map(self, shm_path: str | None, size: int | None) -> None:
        if not (shm_path and size and same_host(self.host_id)):
            return
        self._mmap = map_read_only(shm_path, size)
        if self._mmap is None:
            return  # not ours to read (another uid), or the node moved: TCP it is
        self.arena = memoryview(self._mmap)
        if size <= POPULATE_MAX:  # its page tables cost 2 MiB per GiB of arena
            populate(self._mmap, size, write=False)
        log.debug("reading node %s through shm %s", self.address, shm_path)

    @property
    def shm(self) -> bool:
        """Whether the node's arena is mapped here (so it is on this host)."""
        return self.arena is not None

    def take_unpins(self) -> list[int]:
        out, self.unpins = self.unpins, []
        return out

    def unpin_later(self, pin_id: int) -> None:
        if pin_id:
            self.unpins.append(pin_id)
            if len(self.unpins) >= MAX_PENDING_UNPINS:
                self.flush()

    def served_from_index(self, keys: list[str]) -> None:
        self.touched += keys
        if len(self.touched) >= MAX_PENDING_TOUCHES:
            self.flush()

    def release_pins(self) -> None:
        """Unpin now and wait for the node to have done it (before a remove of what we read)."""
        if self.unpins:
            self.rpc.call(NodePin([], self.take_unpins()))

    def flush(self) -> None:
        """Send pending unpins and index-read reports now (one-way)."""
        if self.unpins or self.touched:
            touched, self.touched = self.touched, []
            self.rpc.send_oneway(NodeUnpin(self.take_unpins(), touched))

    def close(self) -> None:
        try:
            self.flush()
        except Exception:  # the node may be gone; its pins expire by themselves
            pass
        self.rpc.close()
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self.index is not None:
            self.index.close()
            self.index = None
        if self.arena is not None:
            self.arena.release()
            self.arena = None
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None


def fan_out(items: Sequence[tuple[NodeConn, Any]],
            request: Callable[[NodeConn, Any], tuple[Any, Sequence[Any]]]) -> list[tuple[NodeConn, Any, Any]]:
    """Send `request(node, ctx)` -> (message, payload buffers) for every (node, ctx) before
    awaiting any reply, so the nodes work at once; returns (node, ctx, the reply or the
    `KVPoolError` that node failed with) for each. Reply payloads are left to the caller."""
    if len(items) == 1:  # one node (every single put): nothing to overlap
        conn, ctx = items[0]
        msg, buffers = request(conn, ctx)
        try:
            conn.rpc.send_request(msg, buffers)
            return [(conn, ctx, conn.rpc.recv_reply())]
        except KVPoolError as exc:
            return [(conn, ctx, exc)]
    out, sent = [], []
    for conn, ctx in items:
        msg, buffers = request(conn, ctx)
        try:
            conn.rpc.send_request(msg, buffers)
            sent.append((conn, ctx))
        except Unavailable as exc:
            out.append((conn, ctx, exc))
    for conn, ctx in sent:
        try:
            out.append((conn, ctx, conn.rpc.recv_reply()))
        except KVPoolError as exc:  # read the other replies anyway: each socket stays in step
            out.append((conn, ctx, exc))
    return out
