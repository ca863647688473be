"""The tiers of one node: DRAM (shared-memory arena), SSD (lmdb), and the
`TieredStore` that moves objects between them. See `base.py` for the tier contract."""

from kvpool.tiers.base import Tier
from kvpool.tiers.dram import DramTier
from kvpool.tiers.policy import make_policy
from kvpool.tiers.ssd import SsdTier
from kvpool.tiers.store import TieredStore

__all__ = ["DramTier", "SsdTier", "Tier", "TieredStore", "make_policy"]
