"""FAKE minimal stand-ins for SGLang's HiCache storage API (used only where SGLang is absent).

They mirror `sglang.srt.mem_cache.hicache_storage`: the `HiCacheStorageConfig` fields a backend
reads, `HiCacheStorageExtraInfo`, and the `HiCacheStorage` base with its abstract generic
methods (`get`, `batch_get`, `set`, `batch_set`, `exists`) and defaults. When SGLang is installed,
`engine_adapters.sglang` subclasses the real base class instead.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, List, Optional


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


class _FakeHiCacheStorage(ABC):
    """FAKE stand-in for SGLang's HiCacheStorage base; it stands in only where SGLang is absent."""

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.mem_pool_host = mem_pool_host

    def batch_get_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        raise NotImplementedError()

    def batch_set_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        raise NotImplementedError()

    @abstractmethod
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any: ...

    @abstractmethod
    def batch_get(self, keys: List[str], target_locations: Any = None, target_sizes: Any = None) -> Any: ...

    @abstractmethod
    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool: ...

    @abstractmethod
    def batch_set(self, keys: List[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None) -> bool: ...

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        for i, key in enumerate(keys):
            if not self.exists(key):
                return i
        return len(keys)

    def clear(self) -> None:
        pass

    def get_stats(self):
        return None
