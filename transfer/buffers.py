"""Turning the buffers callers hand us into flat writable byte views.

Accepted: bytearray, memoryview (writable), mmap, numpy arrays (C-contiguous), torch CPU
tensors (contiguous, any dtype); bytes for the source of a WRITE. CUDA tensors never get a
view here: the engine stages ops on them through host memory (transfer/staging.py).
A view returned here keeps its owner alive (the view's exporter holds a reference).
"""

from __future__ import annotations

import ctypes
from typing import Any

from transfer.errors import InvalidOp


def byte_view(buffer: Any, *, writable: bool = True) -> memoryview:
    """A 1-D unsigned-byte memoryview over `buffer` (no copy)."""
    if _is_torch_tensor(buffer):
        return _torch_view(buffer)
    try:
        view = memoryview(buffer)
    except TypeError as exc:
        raise InvalidOp(f"unsupported buffer type {type(buffer).__name__}") from exc
    if writable and view.readonly:
        raise InvalidOp(f"buffer of type {type(buffer).__name__} is read-only")
    if not view.c_contiguous:
        raise InvalidOp("buffer must be C-contiguous")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def is_cuda_tensor(obj: Any) -> bool:
    return _is_torch_tensor(obj) and bool(obj.is_cuda)


def _is_torch_tensor(obj: Any) -> bool:
    mod = type(obj).__module__
    return mod.startswith("torch") and hasattr(obj, "data_ptr") and hasattr(obj, "is_cuda")


def _torch_view(tensor: Any) -> memoryview:
    if tensor.is_cuda:
        # Ops on CUDA tensors are staged by the engine (transfer.staging); segments cannot be.
        raise InvalidOp("a CUDA tensor cannot be registered as a segment (peers could not reach it "
                        "without GPUDirect RDMA); register a pinned CPU tensor instead")
    if not tensor.is_contiguous():
        raise InvalidOp("torch tensor must be contiguous")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    # A ctypes array over the tensor's storage; `_keep` pins the tensor while the view lives.
    raw = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    raw._keep = tensor  # type: ignore[attr-defined]
    return memoryview(raw).cast("B")
