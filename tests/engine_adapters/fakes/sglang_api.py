"""FAKE minimal stand-ins for SGLang's HiCache storage API objects a backend is handed.

They mirror `sglang.srt.mem_cache.hicache_storage`: the `HiCacheStorageConfig` fields a backend
reads and `HiCacheStorageExtraInfo`. The backend needs no fake base class: it subclasses SGLang's
`HiCacheStorage` where SGLang is installed and `object` elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional


@dataclass
class FakeHiCacheStorageConfig:
    """FAKE stand-in for SGLang's HiCacheStorageConfig."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    is_mla_model: bool = False
    enable_storage_metrics: bool = False
    is_page_first_layout: bool = False
    model_name: Optional[str] = None
    dp_rank: int = 0
    dp_size: int = 1
    extra_config: Optional[dict] = None


@dataclass
class FakeHiCacheStorageExtraInfo:
    """FAKE stand-in for SGLang's HiCacheStorageExtraInfo."""

    prefix_keys: Optional[List[str]] = None
    extra_info: Optional[dict] = None
