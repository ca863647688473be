"""transfer: move bytes between registered buffers of processes (shm, tcp, rdma).

It knows nothing about keys or KV caches and imports nothing from `kvpool`.

    eng = TransferEngine().start()
    seg = eng.register(buffer)                  # -> SegmentDescriptor (ship seg.to_bytes())
    batch = eng.submit([Op(READ, local, 0, remote_seg, 0, n)])
    batch.wait()                                # or batch.poll(), or `await batch`
"""

from transfer.batch import READ, WRITE, Batch, Op
from transfer.descriptor import SegmentDescriptor
from transfer.engine import TransferEngine
from transfer.errors import (InvalidOp, ProtocolError, SegmentNotFound, TransferError, TransferTimeout,
                             TransportUnavailable)
from transfer.route import ROUTES, local_host_id, route, same_host
from transfer.shm import create_shm_buffer

__all__ = ["READ", "ROUTES", "WRITE", "Batch", "InvalidOp", "Op", "ProtocolError", "SegmentDescriptor",
           "SegmentNotFound", "TransferEngine", "TransferError", "TransferTimeout", "TransportUnavailable",
           "create_shm_buffer", "local_host_id", "route", "same_host"]
