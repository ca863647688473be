"""The tiers of one node: DRAM (shared-memory arena), SSD (lmdb), HBM (CUDA), and the
`TieredStore` that moves objects between them. See `base.py` for the tier contract."""

from kvpool.tiers.allocator import PageAllocator
from kvpool.tiers.base import Location, Reservation, Tier
from kvpool.tiers.dram import DramTier
from kvpool.tiers.hbm import HbmTier, cuda_unavailable_reason
from kvpool.tiers.policy import ARCPolicy, EvictionPolicy, LRUPolicy, S3FIFOPolicy, make_policy
from kvpool.tiers.ssd import SsdTier
from kvpool.tiers.store import TieredStore

__all__ = [
    "ARCPolicy", "DramTier", "EvictionPolicy", "HbmTier", "LRUPolicy", "Location", "PageAllocator", "Reservation",
    "S3FIFOPolicy", "SsdTier", "Tier", "TieredStore", "cuda_unavailable_reason", "make_policy",
]
