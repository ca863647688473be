"""DRAM tier: objects carved out of one shared-memory arena by a page allocator.

Objects live at fixed offsets in `arena.buffer`, so a same-host reader that maps `arena.path`
reads them in place, and a remote writer's bytes land in place through a reservation
(`reserve` -> write at `offset` -> `commit`).

Invariants:
- An entry is visible (`contains`, `get`, `keys`) iff it was `put` or `commit`ted and not removed.
- A reservation owns its arena range from `reserve` until `commit` or `abort`; nothing else
  is ever placed there.
- `used` is the page-rounded sum of live allocations (visible or reserved) and never exceeds
  `capacity`.
- With an index (`kvpool.shm.index`), every visible object is published there at
  `commit` and unpublished before its space is freed (`remove`), or earlier (`unpublish`).
Not thread-safe by itself: `TieredStore` serializes calls and handles pins.
"""

from __future__ import annotations

from typing import Any, Iterator

from kvpool.contract import check_stored_key as check_key
from kvpool.errors import AlreadyExists, CapacityError, InvalidArgument, KeyNotFound, ObjectTooLarge
from kvpool.tiers.allocator import PageAllocator
from kvpool.shm.arena import SharedArena
from kvpool.tiers.base import Location, Reservation
from kvpool.shm.views import readable_view, writable_view
from kvpool.shm.index import ShmIndex, auto_slots, index_path, supported


class DramTier:
    """Objects in a shared-memory arena of `capacity` bytes."""

    name = "dram"

    def __init__(self, capacity: int, index_slots: int = -1):
        """`index_slots`: size of the shared-memory index for same-host readers (-1: sized from
        `capacity`, 0: none; never on CPUs where its readers would not be sound)."""
        self.arena = SharedArena.create(capacity)
        self.allocator = PageAllocator(capacity)
        self._entries: dict[str, tuple[int, int]] = {}  # visible key -> (offset, length)
        self._pending: dict[str, tuple[int, int]] = {}  # reserved, not yet committed
        self.index: ShmIndex | None = None
        if index_slots and supported():
            try:
                self.index = ShmIndex(index_path(self.arena.path),
                                      auto_slots(capacity) if index_slots < 0 else index_slots)
            except BaseException:
                self.arena.close()
                raise

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def used(self) -> int:
        return self.allocator.used

    def __len__(self) -> int:
        return len(self._entries)

    # -- two-phase write -------------------------------------------------------------------
    def try_reserve(self, key: str, size: int) -> Reservation | None:
        """Reserve `size` bytes for `key`; None when no contiguous free range is large enough.
        `key` is trusted: `TieredStore` (its only caller) and `put` validated it."""
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise InvalidArgument(f"size must be a positive int, got {size!r}")
        if size > self.capacity:
            raise ObjectTooLarge(f"object of {size} bytes exceeds the DRAM tier ({self.capacity} bytes)")
        if key in self._entries or key in self._pending:
            raise AlreadyExists(f"key {key!r} is already stored or being written")
        offset = self.allocator.alloc(size)
        if offset is None:
            return None
        self._pending[key] = (offset, size)
        return Reservation(key, offset, size)

    def reserve(self, key: str, size: int) -> Reservation:
        res = self.try_reserve(check_key(key), size)
        if res is None:
            raise CapacityError(f"no contiguous {size} bytes free in the DRAM tier")
        return res

    def commit(self, key: str) -> None:
        try:
            entry = self._entries[key] = self._pending.pop(key)
        except KeyError:
            raise KeyNotFound(f"no reservation for {key!r}") from None
        if self.index is not None:
            self.index.publish(key, *entry)

    def unpublish(self, key: str) -> None:
        """Hide `key` from same-host index readers now (its space stays held until `remove`)."""
        if self.index is not None:
            self.index.unpublish(key)

    def remove(self, key: str) -> bool:
        self.unpublish(key)  # first: an index reader must never find space that is being freed
        return self._free(self._entries.pop(check_key(key), None))

    def abort(self, key: str) -> bool:
        return self._free(self._pending.pop(key, None))

    def _free(self, entry: tuple[int, int] | None) -> bool:
        if entry is not None:
            self.allocator.free(entry[0])
        return entry is not None

    def view(self, key: str) -> memoryview:
        """The arena slice of a visible or reserved object (valid until it is freed)."""
        offset, length = self._entries.get(key) or self._pending[key]
        return self.arena.buffer[offset : offset + length]

    def location(self, key: str) -> Location | None:
        entry = self._entries.get(key)
        return None if entry is None else Location(*entry)

    # -- the Tier contract -----------------------------------------------------------------
    def put(self, key: str, data: Any) -> None:
        src = readable_view(data)
        if check_key(key) in self._entries:
            return
        res = self.reserve(key, src.nbytes)
        self.arena.buffer[res.offset : res.offset + res.length] = src
        self.commit(key)

    def get(self, key: str) -> bytes | None:
        entry = self._entries.get(check_key(key))
        if entry is None:
            return None
        return bytes(self.arena.buffer[entry[0] : entry[0] + entry[1]])

    def get_into(self, key: str, buffer: Any) -> int:
        entry = self._entries.get(check_key(key))
        if entry is None:
            raise KeyNotFound(key)
        offset, length = entry
        writable_view(buffer, length)[:length] = self.arena.buffer[offset : offset + length]
        return length

    def contains(self, key: str) -> bool:
        return check_key(key) in self._entries

    def size_of(self, key: str) -> int | None:
        entry = self._entries.get(check_key(key))
        return None if entry is None else entry[1]

    def keys(self) -> Iterator[tuple[str, int]]:
        return iter([(k, n) for k, (_, n) in self._entries.items()])

    def close(self) -> None:
        self._entries.clear()
        self._pending.clear()
        if self.index is not None:
            self.index.close()
        self.arena.close()
