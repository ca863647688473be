"""SSD -> DRAM promotion, the read path's slow half of `TieredStore` (kvpool.tiers.store).

A read of an object held only by SSD reserves DRAM for it under the store's lock
(`_start_promotion`), copies it out of lmdb outside the lock (`_read_ssd`), then commits or
cancels the reservation under the lock again (`_finish_promotion`). While `entry.promoting` is
set the SSD copy is not evictable and a `remove` defers to the promoter. The store's docstring
states the locking rules this follows.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable

from kvpool.errors import CapacityError, KeyNotFound
from kvpool.tiers.base import Reservation

if TYPE_CHECKING:
    from kvpool.tiers.store import _Entry


class SsdPromotion:
    """Mixed into `TieredStore`, whose attributes these methods use."""

    _lock: threading.Lock
    _promoted: threading.Condition
    _entries: Any
    _stats: Any
    _shelf: Any
    _dram_policy: Any
    dram: Any
    ssd: Any
    _make_room: Callable[..., Reservation]
    _fire: Callable[[list], None]

    def _start_promotion(self, key: str, entry: _Entry, events: list) -> Reservation | None:
        """Reserve DRAM for an SSD object (lock held); None when another promotion is in flight
        or DRAM is all pinned (the read is then served from SSD alone)."""
        self._shelf.policy.access(key)
        if entry.promoting:
            return None
        # Flag first: making room may demote into SSD, and that must not evict this object's
        # own SSD copy (promoting objects are not SSD-evictable).
        entry.promoting = True
        try:
            return self._make_room(key, entry.size, events)
        except CapacityError:
            entry.promoting = False
            self._promoted.notify_all()
            return None

    def _read_ssd(self, key: str, dst: memoryview, res: Reservation | None, pin: bool = False) -> None:
        """Read an SSD object into `dst` outside the lock, then finish its promotion into `res`
        (when `pin`, `dst` is the reservation itself and the object stays pinned).
        Raises KeyNotFound when the copy is gone or damaged, or a pin's promotion was cancelled."""
        try:
            ok = self.ssd.get_into(key, dst) == len(dst)
        except KeyNotFound:
            ok = False
        if ok and res is not None and not pin:
            self.dram.arena.buffer[res.offset : res.offset + res.length] = dst
        promoted = False
        events: list = []
        with self._lock:
            entry = self._entries.get(key)
            if ok:
                self._stats.ssd.hit(len(dst))
            else:
                self._stats.ssd.misses += 1
            if res is not None and entry is not None:
                promoted = self._finish_promotion(key, entry, ok, pin, events)
                self._promoted.notify_all()
            elif not ok and entry is not None and entry.ssd and not self.ssd.contains(key):
                # the SSD tier dropped a damaged copy: forget it
                entry.ssd = False
                self._shelf.policy.remove(key)
                if not (entry.dram or entry.promoting):
                    del self._entries[key]
                    events.append((key, "removed"))
        self._fire(events)
        if not ok or (pin and not promoted):
            raise KeyNotFound(key)

    def _finish_promotion(self, key: str, entry: _Entry, ok: bool, pin: bool, events: list) -> bool:
        """Commit (True) or cancel (False) a promotion; lock held."""
        entry.promoting = False
        if ok and not entry.removing:
            self.dram.commit(key)
            entry.dram = True
            entry.pins += 1 if pin else 0
            self._dram_policy.insert(key, entry.size)
            self._stats.dram.bytes_in += entry.size
            events.append((key, "promoted"))
            return True
        self.dram.abort(key)
        if not ok and entry.ssd:
            entry.ssd = False
            self._shelf.policy.remove(key)
            events.append((key, "removed"))
        if entry.removing or not (entry.dram or entry.ssd):
            del self._entries[key]
        return False
