"""The simulated pool: a DRAM tier and an optional SSD tier of KV blocks, each ordered by one of
the real eviction policies (`kvpool.tiers.policy`, run unchanged), with per-tier traffic.

A block is one trace block (`block_tokens` tokens of KV, `block_bytes` bytes). New blocks enter
DRAM; a block evicted from DRAM is demoted to SSD (write-behind) when there is an SSD tier, else
dropped; a hit on SSD promotes the block back to DRAM. A tier's capacity counts whole blocks
(`None`: unlimited, no eviction).

Invariants: a block is in at most one tier; a tier never holds more blocks than its capacity
after `store` returns; `match` has no side effects (the router may ask about every instance).
"""

from __future__ import annotations

from typing import Sequence

from kvpool.tiers.policy import make_policy


def _always(_key: object) -> bool:
    return True  # nothing is pinned in the simulation: reads are instantaneous events


class SimTier:
    def __init__(self, name: str, capacity_blocks: int | None, block_bytes: int, eviction: str):
        self.name = name
        self.capacity = capacity_blocks
        self.block_bytes = block_bytes
        self.policy = None if capacity_blocks is None else make_policy(eviction, max(1, capacity_blocks) * block_bytes)
        self._keys: set[int] = set()  # unlimited tier
        self.reads = self.writes = self.evictions = 0  # in blocks

    def __contains__(self, key: int) -> bool:
        return key in self._keys if self.policy is None else key in self.policy

    def __len__(self) -> int:
        return len(self._keys) if self.policy is None else len(self.policy)

    def insert(self, key: int) -> list[int]:
        """Add `key`; returns the keys evicted to make room."""
        self.writes += 1
        if self.policy is None:
            self._keys.add(key)
            return []
        self.policy.insert(key, self.block_bytes)  # type: ignore[arg-type]
        out = []
        while len(self.policy) > self.capacity:
            victim = self.policy.evict(_always)
            if victim is None:
                break
            out.append(victim)
        self.evictions += len(out)
        return out  # type: ignore[return-value]

    def access(self, key: int) -> None:
        self.reads += 1
        if self.policy is not None:
            self.policy.access(key)  # type: ignore[arg-type]

    def touch(self, key: int) -> None:
        """Recency without traffic (the block was used where it already is)."""
        if self.policy is not None:
            self.policy.access(key)  # type: ignore[arg-type]

    def remove(self, key: int) -> None:
        if self.policy is None:
            self._keys.discard(key)
        else:
            self.policy.remove(key)  # type: ignore[arg-type]


class SimPool:
    def __init__(self, dram_blocks: int | None, ssd_blocks: int | None, block_bytes: int, eviction: str = "lru"):
        self.block_bytes = block_bytes
        self.dram = SimTier("dram", dram_blocks, block_bytes, eviction) if dram_blocks != 0 else None
        self.ssd = SimTier("ssd", ssd_blocks, block_bytes, eviction) if ssd_blocks else None
        self.promotions = self.demotions = self.dropped = 0

    def match(self, blocks: Sequence[int]) -> int:
        """Length of the leading run of `blocks` held in any tier."""
        dram, ssd = self.dram, self.ssd
        n = 0
        for b in blocks:
            if (dram is None or b not in dram) and (ssd is None or b not in ssd):
                break
            n += 1
        return n

    def read(self, blocks: Sequence[int], n: int) -> tuple[int, int]:
        """Read the first `n` blocks (all present): returns (from DRAM, from SSD); SSD hits move up."""
        from_dram = from_ssd = 0
        for b in blocks[:n]:
            if self.dram is not None and b in self.dram:
                self.dram.access(b)
                from_dram += 1
            elif self.ssd is not None and b in self.ssd:
                self.ssd.access(b)
                from_ssd += 1
                if self.dram is not None:
                    self.ssd.remove(b)
                    self.promotions += 1
                    self._into_dram(b)
        return from_dram, from_ssd

    def store(self, blocks: Sequence[int]) -> int:
        """Write the blocks not yet held and refresh the ones held (the instance just used them:
        so every request references all of its blocks, in order, whatever it hit; that keeps LRU
        a stack algorithm, hit ratio monotone in capacity). Returns how many were written."""
        written = 0
        for b in blocks:
            if self.dram is not None and b in self.dram:
                self.dram.touch(b)
                continue
            if self.ssd is not None and b in self.ssd:
                self.ssd.touch(b)
                continue
            written += 1
            if self.dram is not None:
                self._into_dram(b)
            elif self.ssd is not None:
                self.dropped += len(self.ssd.insert(b))
        return written

    def _into_dram(self, key: int) -> None:
        for victim in self.dram.insert(key):  # type: ignore[union-attr]
            if self.ssd is not None:
                self.demotions += 1
                self.dropped += len(self.ssd.insert(victim))
            else:
                self.dropped += 1

    def traffic(self) -> dict[str, int]:
        """Bytes moved per tier."""
        bb = self.block_bytes
        out = {"dram_write_bytes": 0, "dram_read_bytes": 0, "ssd_write_bytes": 0, "ssd_read_bytes": 0,
               "promoted_bytes": self.promotions * bb, "demoted_bytes": self.demotions * bb,
               "dropped_bytes": self.dropped * bb}
        for tier in (self.dram, self.ssd):
            if tier is not None:
                out[f"{tier.name}_write_bytes"] = tier.writes * bb
                out[f"{tier.name}_read_bytes"] = tier.reads * bb
        return out
