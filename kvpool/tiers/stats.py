"""Per-tier counters of one node (read by `TieredStore.stats`, exported as metrics by the node)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


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

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    @staticmethod
    def total(parts: list["TierStats"]) -> dict[str, int]:
        out = TierStats()
        for p in parts:
            for name, value in asdict(p).items():
                setattr(out, name, getattr(out, name) + value)
        return asdict(out)
