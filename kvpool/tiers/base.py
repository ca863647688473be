"""The tier contract every tier of one node satisfies, and the small types they share.

A tier stores whole objects under string keys. It never evicts on its own: when it is full,
`put` raises `CapacityError` and the owner (`TieredStore`) decides what to evict or demote.
The same conformance suite (tests/kvpool/tiers/test_conformance.py) runs against every tier.

Invariants of a `Tier`:
- `get`/`get_into` return exactly the bytes of the one `put` that stored the key, or report a
  miss (`None` / `KeyNotFound`); never partial or foreign bytes.
- `used <= capacity` at all times; `used` counts the space the tier really reserves (pages).
- `put` of a key already present replaces nothing and returns (first writer wins).
- Bad input raises `InvalidArgument` (wrong type, empty value, small or read-only buffer) or
  `ObjectTooLarge` (larger than the whole tier), before anything is changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Protocol, runtime_checkable

from kvpool.contract import check_stored_key as check_key
from kvpool.errors import KeyNotFound


@dataclass(frozen=True)
class Location:
    """Where a pinned object's bytes are in the DRAM arena. `from_ssd`: this pin read them from
    the SSD tier (a promotion): the read was an SSD hit, not a DRAM one."""

    offset: int
    length: int
    from_ssd: bool = False


@dataclass(frozen=True)
class Reservation:
    """Space reserved in the DRAM arena for a two-phase write; invisible until committed."""

    key: str
    offset: int
    length: int


@runtime_checkable
class Tier(Protocol):
    name: str

    @property
    def capacity(self) -> int: ...

    @property
    def used(self) -> int: ...

    def put(self, key: str, data: Any) -> None: ...

    def get(self, key: str) -> bytes | None: ...

    def get_into(self, key: str, buffer: Any) -> int: ...

    def contains(self, key: str) -> bool: ...

    def size_of(self, key: str) -> int | None: ...

    def remove(self, key: str) -> bool: ...

    def keys(self) -> Iterator[tuple[str, int]]: ...

    def close(self) -> None: ...


class PagedEntries:
    """The bookkeeping shared by the tiers that carve one arena with a `PageAllocator` (DRAM).

    Subclasses set `self.allocator` and `self._entries` (visible key -> (offset, length)) and
    implement the byte copies (`put`, `get`, `get_into`, `close`).
    """

    allocator: Any
    _entries: dict[str, tuple[int, int]]

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def used(self) -> int:
        return self.allocator.used

    def __len__(self) -> int:
        return len(self._entries)

    def _entry_or_miss(self, key: str) -> tuple[int, int]:
        """(offset, length) of visible `key`; `KeyNotFound` when it is not stored."""
        entry = self._entries.get(check_key(key))
        if entry is None:
            raise KeyNotFound(key)
        return entry

    def contains(self, key: str) -> bool:
        return check_key(key) in self._entries

    def size_of(self, key: str) -> int | None:
        entry = self._entries.get(check_key(key))
        return None if entry is None else entry[1]

    def remove(self, key: str) -> bool:
        entry = self._entries.pop(check_key(key), None)
        if entry is None:
            return False
        self.allocator.free(entry[0])
        return True

    def keys(self) -> Iterator[tuple[str, int]]:
        return iter([(k, n) for k, (_, n) in self._entries.items()])
