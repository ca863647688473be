"""CUDA tensors as the local side of an op: staged through pinned host memory.

The shm and tcp transports move bytes between host buffers, so an op whose local buffer is a
CUDA tensor is rewritten to use a pinned CPU staging tensor of the op's length:
- WRITE: the device bytes are copied to the staging tensor before the op is submitted;
- READ: the staging tensor is copied into the device tensor by a batch hook, which runs
  before the batch reports done, so `wait()` returning means the bytes are on the device.
Invariant: the caller's tensor is touched only for [local_offset, local_offset + length).
"""

from __future__ import annotations

from typing import Any

from transfer.batch import READ, Op
from transfer.errors import InvalidOp


def _flat_bytes(tensor: Any):
    import torch

    if not tensor.is_contiguous():
        raise InvalidOp("CUDA tensor must be contiguous")
    return tensor.reshape(-1).view(torch.uint8)


def stage(index: int, op: Op) -> tuple[Op, Any]:
    """The host-side op to submit instead, and the hook that finishes a READ (None for WRITE)."""
    import torch

    device_bytes = _flat_bytes(op.local)
    lo, n = op.local_offset, op.length
    if lo < 0 or n < 0 or lo + n > device_bytes.numel():
        raise InvalidOp(f"op {index}: local range [{lo}, {lo + n}) outside CUDA tensor of "
                        f"{device_bytes.numel()} bytes")
    # pinned so the device copy is a DMA (pinning needs a CUDA runtime; stage() also runs without one)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    target = device_bytes[lo:lo + n]
    if op.opcode == READ:
        return op._replace(local=host, local_offset=0), (lambda: target.copy_(host))
    host.copy_(target)  # synchronous: the bytes are on the host before anything is sent
    return op._replace(local=host, local_offset=0), None
