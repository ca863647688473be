"""transfer: move bytes between registered buffers of processes (shm, tcp, rdma).

It knows nothing about keys or KV caches and imports nothing from `kvpool`.

    eng = TransferEngine().start()
    seg = eng.register(buffer)                  # -> SegmentDescriptor (ship seg.to_bytes())
    batch = eng.submit([Op(READ, local, 0, remote_seg, 0, n)])
    batch.wait()                                # or batch.poll(), or `await batch`
"""

from transfer.batch import READ, WRITE, Batch, Op
from transfer.descriptor import RdmaEndpoint, SegmentDescriptor
from transfer.engine import PREFERENCE, TransferEngine
from transfer.errors import (AccessDenied, InvalidOp, LimitReached, PeerUnavailable, ProtocolError, SegmentNotFound,
                             TransferError, TransferTimeout, TransportUnavailable)
from transfer.framing import Limits
from transfer.grant import Grants
from transfer.route import ROUTES, local_host_id, route, same_host
from transfer.shm import create_shm_buffer

__all__ = [
    "PREFERENCE",
    "READ",
    "ROUTES",
    "WRITE",
    "AccessDenied",
    "Batch",
    "create_shm_buffer",
    "Grants",
    "InvalidOp",
    "LimitReached",
    "Limits",
    "local_host_id",
    "Op",
    "PeerUnavailable",
    "ProtocolError",
    "route",
    "same_host",
    "RdmaEndpoint",
    "SegmentDescriptor",
    "SegmentNotFound",
    "TransferEngine",
    "TransferError",
    "TransferTimeout",
    "TransportUnavailable",
]
