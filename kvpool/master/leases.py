"""`LeaseTable`: the readers' leases, lease id -> the keys one lookup leased and its expiry.

A lookup leases the complete objects it found under one id (`grant`): each holds the id in its
`ObjectEntry.leases` until the reader releases it (on its next lookup, or `release`) or it
expires (the housekeeping tick ends those of crashed readers). While an object holds an
unexpired lease it is neither evicted nor removed: a remove hides it and waits (`kvpool.master.state`).

Invariants (the caller holds the master's lock): a lease id is here from `grant` until `end`;
until then each of its keys' objects, while still in the object table, holds it (or held it and
let it expire). Lease ids are sequential, so a tenant may end only leases over its own keys (`owned`).
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Sequence

from kvpool.master.tables import ObjectEntry


class LeaseTable:
    def __init__(self) -> None:
        self._keys: dict[int, tuple[list[str], float]] = {}  # lease id -> (keys, expiry)

    def __len__(self) -> int:
        return len(self._keys)

    def grant(self, lease_id: int, objs: Sequence[ObjectEntry], until: float) -> None:
        """`objs` are leased under `lease_id` until `until` (monotonic)."""
        for obj in objs:
            obj.leases[lease_id] = until
        self._keys[lease_id] = ([o.key for o in objs], until)

    def end(self, lease_ids: Iterable[int], get: Callable[[str], ObjectEntry | None]) -> Iterator[ObjectEntry]:
        """End these leases (unknown ids are ignored): each object they covered that `get` (the
        object table's) still finds lets go of it, and is yielded then, so the caller may drop
        a removed one at once (before the next is looked up)."""
        for lid in lease_ids:
            for key in self._keys.pop(lid, ((), 0.0))[0]:
                obj = get(key)
                if obj is not None:
                    obj.leases.pop(lid, None)
                    yield obj

    def expired(self, now: float) -> list[int]:
        """Leases whose reader never released them (a crashed client)."""
        return [lid for lid, (_, until) in self._keys.items() if until <= now]

    def owned(self, lease_ids: Sequence[int], prefix: str) -> list[int]:
        """The leases among `lease_ids` that cover only keys under `prefix` (a tenant's scope)."""
        keys = self._keys
        return [lid for lid in lease_ids
                if (held := keys.get(lid)) is not None and all(k.startswith(prefix) for k in held[0])]

    def clear(self) -> None:
        self._keys.clear()
