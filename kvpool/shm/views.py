"""Flat byte views of what callers hand the pool (bytes, numpy arrays, CPU tensors), without copying."""

from __future__ import annotations

from typing import Any

from kvpool.errors import InvalidArgument


def readable_view(data: Any) -> memoryview:
    """A flat, contiguous byte view of `data` without copying; `InvalidArgument` otherwise."""
    if hasattr(data, "untyped_storage") and hasattr(data, "detach"):  # a torch tensor
        if data.device.type != "cpu":
            raise InvalidArgument("values must be host memory; copy device tensors to the CPU first")
        data = data.detach().contiguous().view(-1).view(__import__("torch").uint8).numpy()
    if isinstance(data, str):
        raise InvalidArgument("value must be bytes-like, got str (encode it first)")
    try:
        view = memoryview(data)
    except TypeError:
        raise InvalidArgument(f"value must be bytes-like, got {type(data).__name__}") from None
    if not view.c_contiguous:
        raise InvalidArgument("value must be a contiguous buffer")
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if view.nbytes == 0:
        raise InvalidArgument("value must not be empty")
    return view


def writable_view(buffer: Any, need: int) -> memoryview:
    """A flat writable byte view of `buffer` holding at least `need` bytes."""
    if hasattr(buffer, "untyped_storage") and hasattr(buffer, "detach"):
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise InvalidArgument("buffer tensors must be contiguous host memory")
        buffer = buffer.detach().view(-1).view(__import__("torch").uint8).numpy()
    try:
        view = memoryview(buffer)
    except TypeError:
        raise InvalidArgument(f"buffer must be a writable bytes-like object, got {type(buffer).__name__}") from None
    if view.readonly:
        raise InvalidArgument("buffer is read-only")
    if not view.c_contiguous:
        raise InvalidArgument("buffer must be contiguous")
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if view.nbytes < need:
        raise InvalidArgument(f"buffer holds {view.nbytes} bytes, the object needs {need}")
    return view
