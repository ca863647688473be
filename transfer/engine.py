"""`TransferEngine`: register buffers as segments, describe them, move bytes to/from peers.

The engine owns one TCP data server (the passive side: peers READ/WRITE our segments through
it, and it carries the RDMA connection set-up) and one instance of each transport it offers.
For each op it takes the route `transfer.route.route` decides from the segment's descriptor (its
host id and transports: shm on the same host, then rdma, then tcp) among the transports usable
here for that segment, unless the caller names one.

Invariants:
- the ops of one batch run concurrently, in no particular order: a batch that reads and
  writes the same bytes gets whichever order the connections produce.
- `submit` validates every op (opcode, local and remote ranges, transport) before any byte
  of the batch moves; a bad op raises `InvalidOp` and nothing is sent.
- a registered segment's memory stays valid until `unregister` (the engine keeps a view).
- every op of a submitted batch finishes (ok or with an error) within about `timeout`
  seconds of its bytes being due, whatever the peer does.

Access: by default anyone who reaches the data port may READ and WRITE every registered byte.
`auth` (principal -> secret) makes every connection prove a principal first (`transfer.auth`),
and `credential` is what this engine proves to its peers. `grant_key` makes the data server
serve only ranges a grant covers (`transfer.grant`; `signer` signs them): the owner of the
segments hands grants out, and callers pass them in `Op.grant`. Same-host shm peers map the
segment's file, which is 0600: only this uid (which could read our memory anyway) gets there.
A grant names the principal it is for; the data server honours it only on a connection
authenticated as that principal.
RDMA: with `grant_key`, segments are registered for remote READ only (a WRITE goes over tcp,
where its grant is checked); a remote READ is still not checked against grants: any peer that
set up queue pairs through the (authenticated) control channel can read every registered
segment it knows the address and rkey of (they are in the descriptor). What would close that:
a type-2 memory window bound per grant (ibv_bind_mw on the owner's QP, its rkey handed out
with the grant and invalidated at expiry); no RDMA device exists here to build it against.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Sequence

from transfer.batch import READ, WRITE, Batch, Op
from transfer import staging
from transfer.buffers import byte_view, is_cuda_tensor
from transfer.descriptor import DESCRIPTOR_VERSION, SegmentDescriptor
from transfer.errors import InvalidOp, SegmentNotFound, TransferError, TransportUnavailable
from transfer.framing import Limits
from transfer.grant import Grants
from transfer.route import ROUTES, local_host_id, route
from transfer.shm import ShmTransport
from transfer.tcp import TcpTransport
from transfer.tcp_server import DataServer

log = logging.getLogger("transfer.engine")


class TransferEngine:
    def __init__(self, name: str | None = None, host: str = "127.0.0.1", port: int = 0,
                 transports: Sequence[str] = ("shm", "tcp", "rdma"), timeout: float = 10.0,
                 connections_per_peer: int = 4, slice_bytes: int = 4 << 20, rdma_device: Any = None,
                 auth: Any = None, credential: tuple[str, bytes] | None = None, grant_key: bytes | None = None,
                 limits: Limits | None = None, rdma_gid_index: int = 0):
        """`rdma_device`: the name of the RDMA device to open (default: the first), or a verbs-layer
        device to use instead of opening one (tests pass a fake); `rdma_gid_index`: its GID index.
        `auth`, `credential`, `grant_key`: see the module doc. `limits`: the data server's
        per-connection limits and caps (`transfer.framing.Limits`; default: its defaults)."""
        unknown = set(transports) - set(ROUTES)
        if unknown:
            raise InvalidOp(f"unknown transports {sorted(unknown)}; known: {list(ROUTES)}")
        if timeout <= 0 or slice_bytes <= 0 or connections_per_peer <= 0:
            raise InvalidOp("timeout, slice_bytes and connections_per_peer must be positive")
        self.name = name or f"engine-{os.getpid()}-{os.urandom(3).hex()}"
        self.host = host
        self.timeout = timeout
        # seg_id -> (name, view), read by the server; the view keeps the registered buffer alive
        self._segments: dict[int, tuple[str, memoryview]] = {}
        self._descriptors: dict[str, SegmentDescriptor] = {}
        self._lock = threading.Lock()
        self._counter = 0
        self._grants = Grants(grant_key, self.name) if grant_key is not None else None
        self.credential = credential
        self._server = DataServer(self._segments, host, port, control=self._control, name=self.name, auth=auth,
                                  grants=self._grants, limits=limits, uncapped=credential[0] if credential else None)
        self.port = self._server.port
        self._started = False
        self._transports: dict[str, Any] = {}
        if "tcp" in transports:
            self._transports["tcp"] = TcpTransport(timeout, connections_per_peer, slice_bytes, credential)
        if "shm" in transports:
            self._transports["shm"] = ShmTransport()
        if "rdma" in transports:
            from transfer import rdma

            opened = rdma.open_transport(self.name, timeout, connections_per_peer, slice_bytes, rdma_device,
                                         rdma_gid_index, credential)
            if opened is not None:
                self._transports["rdma"] = opened

    @property
    def transports(self) -> tuple[str, ...]:
        """The transports this engine can actually use (requested and available here)."""
        return tuple(t for t in ROUTES if t in self._transports)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "TransferEngine":
        if not self._started:
            self._server.start()
            self._started = True
            log.info("transfer engine %s serving on %s:%d (transports: %s)", self.name, self.host, self.port,
                     ", ".join(self.transports))
        return self

    def close(self) -> None:
        for transport in self._transports.values():
            transport.close()
        self._server.close()
        with self._lock:
            self._segments.clear()
            self._descriptors.clear()

    def __enter__(self) -> "TransferEngine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- segments ----------------------------------------------------------------------------
    def register(self, buffer: Any, name: str | None = None, shm_path: str | None = None) -> SegmentDescriptor:
        """Expose `buffer` to peers as a segment; returns the descriptor they need.

        With `shm_path`, `buffer` must be a mapping of that file (same size or smaller);
        then same-host peers reach it by mapping the file themselves.
        """
        view = byte_view(buffer, writable=True)
        if len(view) == 0:
            raise InvalidOp("cannot register an empty buffer")
        if shm_path is not None:
            try:
                file_size = os.stat(shm_path).st_size
            except OSError as exc:
                raise InvalidOp(f"shm_path {shm_path!r}: {exc}") from exc
            if file_size < len(view):
                raise InvalidOp(f"shm_path {shm_path!r} has {file_size} bytes, buffer has {len(view)}")
        with self._lock:
            seg_id = self._counter + 1  # ids are never reused: a stale descriptor misses, never aliases
            name = name if name is not None else f"seg{seg_id}"
            if name in self._descriptors:
                raise InvalidOp(f"segment {name!r} is already registered on {self.name}")
            self._counter = seg_id
            offered = [t for t in self.transports if t != "shm" or shm_path is not None]
            rdma_ep = None
            if "rdma" in self._transports:
                rdma_ep = self._transports["rdma"].register(name, view, remote_write=self._grants is None)
            desc = SegmentDescriptor(name=name, engine=self.name, host=self.host, port=self.port, size=len(view),
                                     transports=tuple(offered), host_id=local_host_id(), pid=os.getpid(),
                                     shm_path=shm_path, rdma=rdma_ep, seg_id=seg_id, version=DESCRIPTOR_VERSION)
            self._descriptors[name] = desc
            self._segments[seg_id] = (name, view)
        return desc

    @property
    def requires_grants(self) -> bool:
        return self._grants is not None

    def signer(self, seg_name: str) -> Any:
        """The grant signer of our segment `seg_name`: (opcode, offset, length, ttl_s, principal)
        -> a grant for `opcode` on [offset, offset + length), valid `ttl_s` seconds, to the peer
        whose data connection proves `principal` ("": this engine authenticates nobody); None
        when this engine does not require grants."""
        if self._grants is None:
            return None
        return self._grants.signer(self.descriptor(seg_name).seg_id)

    def revoke(self, grant: bytes | None) -> None:
        """Refuse a grant this engine signed from now on (see `transfer.grant`)."""
        if self._grants is not None and grant:
            self._grants.revoke(grant)

    def unregister(self, seg_name: str) -> None:
        with self._lock:
            desc = self.descriptor(seg_name)
            del self._descriptors[seg_name]
            self._segments.pop(desc.seg_id, None)
            if "rdma" in self._transports:
                self._transports["rdma"].unregister(seg_name)

    def descriptor(self, seg_name: str) -> SegmentDescriptor:
        try:
            return self._descriptors[seg_name]
        except KeyError:
            raise SegmentNotFound(f"no segment {seg_name!r} on {self.name}") from None

    # -- transfers ---------------------------------------------------------------------------
    def choose(self, desc: SegmentDescriptor, transport: str | None = None) -> str:
        """The transport an op on `desc` would use (the best one both sides offer)."""
        usable = [t for t, impl in self._transports.items() if impl.usable(desc)]
        name = route(desc.host_id, desc.transports, usable) if transport is None else transport
        if name in usable:
            return name
        why = "no shared transport with" if transport is None else f"transport {transport!r} not usable for"
        raise TransportUnavailable(f"{why} segment {desc.name!r} of {desc.engine} "
                                   f"(we offer {list(self.transports)}, it offers {list(desc.transports)})")

    def _validate(self, index: int, op: Op, transport: str | None, views: dict,
                  chosen: dict) -> tuple[str, memoryview]:
        """Check one op; `views`/`chosen` cache per-buffer and per-segment work within a submit."""
        if op.opcode not in (READ, WRITE):
            raise InvalidOp(f"op {index}: opcode must be READ or WRITE, got {op.opcode!r}")
        desc = op.remote
        if not isinstance(desc, SegmentDescriptor):
            raise InvalidOp(f"op {index}: remote must be a SegmentDescriptor, got {type(desc).__name__}")
        length, lo, ro = op.length, op.local_offset, op.remote_offset
        if length < 0 or lo < 0 or ro < 0:
            raise InvalidOp(f"op {index}: negative length or offset")
        if ro + length > desc.size:
            raise InvalidOp(f"op {index}: remote range [{ro}, {ro + length}) outside segment "
                            f"{desc.name!r} of {desc.size} bytes")
        key = (id(op.local), op.opcode == READ)
        local = views.get(key)
        if local is None:
            local = views[key] = byte_view(op.local, writable=op.opcode == READ)
        if lo + length > len(local):
            raise InvalidOp(f"op {index}: local range [{lo}, {lo + length}) outside buffer of {len(local)} bytes")
        name = chosen.get(id(desc))
        if name is None:
            name = chosen[id(desc)] = self.choose(desc, transport)
        if name == "rdma" and op.opcode == WRITE and not desc.rdma.writable:
            # registered READ-only (the owner requires grants): a WRITE goes where its grant is checked
            if transport == "rdma" or "tcp" not in self._transports or not self._transports["tcp"].usable(desc):
                raise InvalidOp(f"op {index}: segment {desc.name!r} of {desc.engine} takes no RDMA WRITE "
                                "(registered read-only) and no tcp is shared")
            name = "tcp"
        return name, local[lo:lo + length]

    def submit(self, ops: Sequence[Op], transport: str | None = None) -> Batch:
        """Start moving `ops`; returns at once with a `Batch` to wait on (shm ops are done already)."""
        ops = list(ops)
        groups: dict[str, list[tuple[int, Op, memoryview]]] = {}
        # ids are stable here: `ops` holds every buffer and descriptor alive during the loop
        views: dict = {}
        choices: dict = {}
        hooks = []
        for index, op in enumerate(ops):
            if not isinstance(op, Op):
                op = ops[index] = Op(*op)
            if is_cuda_tensor(op.local):
                op, hook = staging.stage(index, op)
                if hook is not None:
                    hooks.append((index, hook))
            chosen, local = self._validate(index, op, transport, views, choices)
            groups.setdefault(chosen, []).append((index, op, local))
        batch = Batch(ops, next(iter(groups)) if len(groups) == 1 else "mixed")
        batch._hooks = hooks
        for name, work in groups.items():
            self._transports[name].submit(batch, work)
        batch._seal()
        return batch

    def read(self, seg: SegmentDescriptor, remote_offset: int, local_buffer: Any, local_offset: int = 0,
             length: int | None = None, transport: str | None = None, grant: bytes | None = None) -> None:
        """Copy `length` bytes of the remote segment into `local_buffer` (synchronously)."""
        self._one(Op(READ, local_buffer, local_offset, seg, remote_offset, length, grant), transport)

    def write(self, seg: SegmentDescriptor, remote_offset: int, local_buffer: Any, local_offset: int = 0,
              length: int | None = None, transport: str | None = None, grant: bytes | None = None) -> None:
        """Copy `length` bytes of `local_buffer` into the remote segment (synchronously)."""
        self._one(Op(WRITE, local_buffer, local_offset, seg, remote_offset, length, grant), transport)

    def _one(self, op: Op, transport: str | None) -> None:
        """One op, synchronously; a `length` of None: to the end of the local buffer."""
        local = op.local
        cuda = is_cuda_tensor(local)
        if op.length is None:
            nbytes = local.numel() * local.element_size() if cuda else len(byte_view(local, writable=False))
            op = op._replace(length=nbytes - op.local_offset)
        if cuda:
            self.submit([op], transport).wait()
            return
        chosen, local = self._validate(0, op, transport, {}, {})
        if chosen == "tcp":
            # No hand-off to a connection thread: a sync single op runs on the caller's thread.
            try:
                self._transports["tcp"].run_inline(op, local)
            except TransferError as exc:
                raise type(exc)(f"1 of 1 ops failed; op 0: {exc}", {0: exc}) from exc
            return
        batch = Batch([op], chosen)
        self._transports[chosen].submit(batch, [(0, op, local)])
        batch._seal()
        batch.wait()

    # -- control channel -----------------------------------------------------------------------
    def _control(self, msg: object) -> object:
        rdma = self._transports.get("rdma")
        if rdma is not None:
            return rdma.handle_control(msg)
        from transfer import wire

        return wire.ControlError(f"{type(msg).__name__}: rdma not offered by {self.name}")

    def __repr__(self) -> str:
        return f"<TransferEngine {self.name} {self.host}:{self.port} {list(self.transports)}>"
