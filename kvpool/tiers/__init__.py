"""The tiers of one node: DRAM (shared-memory arena), SSD (lmdb), and the
`TieredStore` that moves objects between them. See `base.py` for the tier contract."""

from kvpool.tiers.allocator import PageAllocator
from kvpool.tiers.base import Location, Reservation, Tier
from kvpool.tiers.dram import DramTier
from kvpool.tiers.policy import ARCPolicy, EvictionPolicy, LRUPolicy, S3FIFOPolicy, make_policy
from kvpool.tiers.ssd import SsdTier
from kvpool.tiers.store import TieredStore

__all__ = [
    "ARCPolicy", "DramTier", "EvictionPolicy", "LRUPolicy", "Location", "PageAllocator", "Reservation",
    "S3FIFOPolicy", "SsdTier", "Tier", "TieredStore", "make_policy",
]
