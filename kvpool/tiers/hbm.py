"""HBM tier: objects in one pre-allocated device tensor, carved by the same page allocator.

Present only where CUDA is: `HbmTier(capacity)` raises `Unavailable` (with the reason) on a
machine without it, and callers (TieredStore, the tests) skip it cleanly. `device="cpu"` runs the
very same code on a host tensor, so the conformance suite exercises it on every machine.

Invariants: as for every tier (see `base.py`); copies between host buffers and the arena go
through `torch` tensor views of the caller's buffer, without an intermediate host copy.
"""

from __future__ import annotations

import logging
from typing import Any

from kvpool.contract import check_stored_key as check_key
from kvpool.errors import CapacityError, ObjectTooLarge, Unavailable
from kvpool.tiers.allocator import PageAllocator
from kvpool.tiers.base import PagedEntries
from kvpool.shm.views import readable_view, writable_view

log = logging.getLogger(__name__)


def cuda_unavailable_reason() -> str | None:
    """None when a CUDA device can be used, else why not."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} reports no CUDA device (torch.version.cuda={torch.version.cuda})"
    return None


def _host_tensor(view: memoryview):
    import warnings

    import torch

    with warnings.catch_warnings():  # read-only sources warn; we never write through them
        warnings.simplefilter("ignore")
        return torch.frombuffer(view, dtype=torch.uint8)


class HbmTier(PagedEntries):
    """Objects in a `capacity`-byte uint8 tensor on `device`."""

    name = "hbm"

    def __init__(self, capacity: int, device: str = "cuda"):
        import torch

        if device.startswith("cuda"):
            reason = cuda_unavailable_reason()
            if reason is not None:
                raise Unavailable(f"HBM tier unavailable: {reason}")
        self.device = torch.device(device)
        self.allocator = PageAllocator(capacity)
        self.arena = torch.empty(self.allocator.capacity, dtype=torch.uint8, device=self.device)
        self._entries: dict[str, tuple[int, int]] = {}

    def tensor(self, key: str):
        """The device slice holding `key` (a view; valid until the object is removed)."""
        offset, length = self._entries[key]
        return self.arena[offset : offset + length]

    def put(self, key: str, data: Any) -> None:
        src = readable_view(data)
        if check_key(key) in self._entries:
            return
        if src.nbytes > self.capacity:
            raise ObjectTooLarge(f"object of {src.nbytes} bytes exceeds the HBM tier ({self.capacity} bytes)")
        offset = self.allocator.alloc(src.nbytes)
        if offset is None:
            raise CapacityError(f"no contiguous {src.nbytes} bytes free in the HBM tier")
        self.arena[offset : offset + src.nbytes].copy_(_host_tensor(src))
        self._entries[key] = (offset, src.nbytes)

    def get(self, key: str) -> bytes | None:
        entry = self._entries.get(check_key(key))
        if entry is None:
            return None
        out = bytearray(entry[1])
        self.get_into(key, out)
        return bytes(out)

    def get_into(self, key: str, buffer: Any) -> int:
        offset, length = self._entry_or_miss(key)
        dst = writable_view(buffer, length)[:length]
        _host_tensor(dst).copy_(self.arena[offset : offset + length])
        return length

    def close(self) -> None:
        self._entries.clear()
        self.arena = None


def open_hbm(capacity: int) -> HbmTier | None:
    """An HBM tier of `capacity` bytes, or None (logged) where CUDA is not usable."""
    try:
        return HbmTier(capacity)
    except Unavailable as exc:
        log.warning("running without an HBM tier: %s", exc)
        return None
