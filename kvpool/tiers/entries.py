"""What a node's store knows of each object it holds (`Entry`), and its index (`EntryIndex`),
which keeps each tenant's use (`kvpool.tiers.tenants` checks quotas against it) and the store's
totals in step with every change, so that reading them costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpool.tiers.policy import tenant_of


@dataclass
class Entry:
    size: int
    dram: bool = False  # committed in DRAM (space held until removed or last unpin)
    ssd: bool = False  # a verified-at-write copy in SSD
    pins: int = 0
    writing: bool = False  # reserved by a two-phase writer, not yet committed
    promoting: bool = False  # an SSD -> DRAM copy is in flight
    removing: bool = False  # removed while pinned or promoting: invisible, freed later

    index: Any = field(default=None, repr=False, compare=False)  # the EntryIndex counting it, told of every change

    @property
    def visible(self) -> bool:
        return not self.writing and not self.removing and (self.dram or self.ssd)

    def totals(self) -> tuple[bool, int, bool]:
        return self.visible, self.size, self.pins > 0

    def __setattr__(self, name: str, value: Any) -> None:
        index = self.__dict__.get("index")
        if index is None or name == "index":
            object.__setattr__(self, name, value)
            return
        before = self.totals()
        object.__setattr__(self, name, value)
        index.changed(before, self.totals())


class EntryIndex(dict):
    """The store's index (key -> `Entry`), keeping each tenant's use in step, `usage[tenant] =
    [bytes, keys]` of its entries, and the store's totals: `visible` objects, `visible_bytes`,
    `pinned` objects (each entry tells `changed` what its change did to them). Entries enter only
    by `index[key] = entry` and leave only by `del` or `pop`. The heartbeat reads the totals every
    second: counting them by a scan cost ~18 ms of GIL at 100,000 objects, every second, a stall
    of every call into the node's process (the router's match_prefix p99)."""

    def __init__(self) -> None:
        super().__init__()
        self.usage: dict[str, list[int]] = {}
        self.visible = self.visible_bytes = self.pinned = 0

    def __setitem__(self, key: str, entry: Any) -> None:
        if key in self:
            del self[key]
        super().__setitem__(key, entry)
        use = self.usage.setdefault(tenant_of(key), [0, 0])
        use[0] += entry.size
        use[1] += 1
        self._count(entry.totals(), 1)
        entry.index = self

    def __delitem__(self, key: str) -> None:
        entry = self[key]
        super().__delitem__(key)
        use = self.usage[tenant_of(key)]
        use[0] -= entry.size
        use[1] -= 1
        entry.index = None
        self._count(entry.totals(), -1)

    def changed(self, before: tuple[bool, int, bool], after: tuple[bool, int, bool]) -> None:
        if before != after:
            self._count(before, -1)
            self._count(after, 1)

    def _count(self, totals: tuple[bool, int, bool], sign: int) -> None:
        visible, size, pinned = totals
        if visible:
            self.visible += sign
            self.visible_bytes += sign * size
        if pinned:
            self.pinned += sign

    def pop(self, key: str, *default: Any) -> Any:  # keep the counts right whichever way an entry goes
        if key not in self:
            if default:
                return default[0]
            raise KeyError(key)
        entry = self[key]
        del self[key]
        return entry
