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

