"""Counters of one node's tiers (read by `TieredStore.stats`, exported as metrics by the node)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_in: int = 0  # bytes written into the tier (puts, commits, demotions, promotions)
    bytes_out: int = 0  # bytes read out of the tier by gets

    def hit(self, nbytes: int) -> None:
        self.hits += 1
        self.bytes_out += nbytes

    @staticmethod
    def total(parts: list["TierStats"]) -> dict[str, int]:
        out = TierStats()
        for p in parts:
            for name, value in asdict(p).items():
                setattr(out, name, getattr(out, name) + value)
        return asdict(out)


@dataclass
class StoreStats:
    """A `TieredStore`'s counters: one `TierStats` per tier, and reads no tier could serve."""

    dram: TierStats = field(default_factory=TierStats)
    ssd: TierStats = field(default_factory=TierStats)
    absent: int = 0  # reads of keys no tier holds (tier misses also count reads served lower)

    def absent_read(self) -> None:
        self.dram.misses += 1
        self.absent += 1

    def report(self, policy: str, tiers: dict[str, Any], entries: Any) -> dict[str, Any]:
        """{"policy", "tiers": {name: {capacity, used, objects, hits, misses, evictions, bytes_in,
        bytes_out}}, "total": {objects, bytes, pinned, hits, misses, evictions, bytes_in, bytes_out}}
        of the tiers present (not None). A tier's misses count reads it could not serve (a DRAM
        miss may be an SSD hit); the total counts each read once. Pins count as reads. `entries`:
        the store's `kvpool.tiers.entries.EntryIndex` (its running totals)."""
        present = {name: tier for name, tier in tiers.items() if tier is not None}
        out = {name: {"capacity": tier.capacity, "used": tier.used, "objects": len(tier),
                      **asdict(getattr(self, name))} for name, tier in present.items()}
        total = {"objects": entries.visible, "bytes": entries.visible_bytes, "pinned": entries.pinned,
                 **TierStats.total([getattr(self, n) for n in present])}
        # Each read is served by one tier (a hit there) or by none: DRAM misses that SSD served
        # are not misses of the store.
        total["misses"] = self.absent + self.ssd.misses
        return {"policy": policy, "tiers": out, "total": total}
