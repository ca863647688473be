"""What a node's store knows of each object it holds (`Entry`), and its index (`EntryIndex`),
which keeps each tenant's use (`kvpool.tiers.tenants` checks quotas against it) and the store's
totals in step with every change, so that reading them costs nothing.
"""

from __future__ import annotations

from typing import Any

from kvpool.security.tenancy import tenant_of


class Entry:
    """One object in the store: its size and where and how it is held. Every change of a field
    that counts (all but `promoting`) tells the `EntryIndex` holding it (`index`) what it did to
    the totals; the fields live in `__dict__`, read directly, because this runs on every put,
    pin and unpin."""

    def __init__(self, size: int, dram: bool = False, ssd: bool = False, pins: int = 0, writing: bool = False,
                 promoting: bool = False, removing: bool = False):
        self.__dict__.update(
            size=size,
            dram=dram,  # committed in DRAM (space held until removed or last unpin)
            ssd=ssd,  # a verified-at-write copy in SSD
            pins=pins,
            writing=writing,  # reserved by a two-phase writer, not yet committed
            promoting=promoting,  # an SSD -> DRAM copy is in flight
            removing=removing,  # removed while pinned or promoting: invisible, freed later
            index=None)  # the EntryIndex counting it

    @property
    def visible(self) -> bool:
        return not self.writing and not self.removing and (self.dram or self.ssd)

    def totals(self) -> tuple[bool, int, bool]:
        return _totals(self.__dict__)

    def __setattr__(self, name: str, value: Any) -> None:
        d = self.__dict__
        index = d["index"]
        if index is None or name == "promoting" or name == "index":
            d[name] = value
            return
        if name == "pins":  # the most frequent change (every pin and unpin): only `pinned` can move
            was = d["pins"] > 0
            d["pins"] = value
            if (value > 0) != was:
                index.pinned += 1 if value > 0 else -1
            return
        before = _totals(d)
        d[name] = value
        after = _totals(d)
        if before != after:
            index.changed(before, after)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items() if k != "index")
        return f"Entry({fields})"


def _totals(d: dict) -> tuple[bool, int, bool]:
    """(visible, size, pinned) of an entry's fields."""
    return not d["writing"] and not d["removing"] and (d["dram"] or d["ssd"]), d["size"], d["pins"] > 0


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
