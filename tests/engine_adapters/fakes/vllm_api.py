"""FAKE minimal stand-ins for the parts of vLLM's v1 KV-connector API our connector touches.

They mirror vLLM 0.32 (`MIRRORS_VLLM`): `KVConnectorRole`, the few config objects the connector
reads, and the attention layers and backends as far as the connector asks them (`get_name`, the
layer's `impl.do_kv_cache_update` that it probes, the older `get_kv_cache_shape`). The FAKE
CPU_ATTN page copies what the real x86 "vec" kernel was seen to store. The real vLLM 0.32 CPU
build runs in tests/engine_adapters/vllm_real; these stand in for what cannot run here (the
CUDA backends). The connector needs no fake base class: it subclasses vLLM's where vLLM is
installed and `object` elsewhere.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

MIRRORS_VLLM = "0.32.0"  # the vLLM release whose API and KV layouts these stand-ins copy


class FakeKVConnectorRole(enum.Enum):
    """FAKE stand-in for vLLM's KVConnectorRole (the connector compares the member's name)."""

    SCHEDULER = 0
    WORKER = 1


# ---- FAKE config objects (the fields of vLLM's VllmConfig that the connector reads) ----


@dataclass
class FakeKVTransferConfig:
    """FAKE stand-in for vLLM's KVTransferConfig (the `--kv-transfer-config` JSON)."""

    kv_connector: str = "KVPoolConnector"
    kv_connector_module_path: str = "engine_adapters.vllm"
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)


@dataclass
class FakeCacheConfig:
    """FAKE stand-in for vLLM's CacheConfig."""

    block_size: int = 16
    cache_dtype: str = "auto"


@dataclass
class FakeParallelConfig:
    """FAKE stand-in for vLLM's ParallelConfig."""

    tensor_parallel_size: int = 1


@dataclass
class FakeModelConfig:
    """FAKE stand-in for vLLM's ModelConfig: the layout getters the connector calls."""

    model: str = "fake/model"
    revision: str | None = None
    dtype: Any = "float16"  # vLLM holds a torch.dtype here
    num_layers: int = 4
    num_kv_heads: int = 2
    head_size: int = 8

    def get_num_layers(self, parallel_config: Any) -> int:
        return self.num_layers

    def get_num_kv_heads(self, parallel_config: Any) -> int:
        return self.num_kv_heads // max(1, parallel_config.tensor_parallel_size)

    def get_head_size(self) -> int:
        return self.head_size


# ---- FAKE attention backends and layers: what each says about its KV cache ----
# vLLM 0.32 backends get the logical page [blocks, heads, block_size, 2 * head_dim] and write it
# through their layer's `impl.do_kv_cache_update`, which the connector probes; older backends
# declared a 5-D shape (`get_kv_cache_shape`).


def cpu_vec_views(kv_cache: Any) -> tuple[Any, Any]:
    """K and V `[blocks, block_size, heads, dim]` views of a FAKE CPU_ATTN page as vLLM 0.32's x86
    "vec" kernel keeps it (observed in tests/engine_adapters/vllm_real): each (block, head) page is
    [2 * block_size, head_dim] rows, K first and stored transposed ([head_dim, block_size]), then V."""
    blocks, heads, size, content = kv_cache.shape
    halves = kv_cache.view(blocks, heads, 2, size * content // 2)
    k = halves[:, :, 0].view(blocks, heads, content // 2, size).permute(0, 3, 1, 2)
    v = halves[:, :, 1].view(blocks, heads, size, content // 2).transpose(1, 2)
    return k, v


def kv_last_views(kv_cache: Any) -> tuple[Any, Any]:
    """K and V views of a FAKE FLASH_ATTN page: `kv_cache.transpose(1, 2).split(head_dim, -1)`."""
    pages = kv_cache.transpose(1, 2)
    return pages[..., : pages.shape[-1] // 2], pages[..., pages.shape[-1] // 2:]


class FakeAttentionImpl:
    """FAKE attention impl: `do_kv_cache_update` stores new K and V at their slots, as vLLM 0.32's does."""

    def __init__(self, views: Any):
        self._views = views

    def do_kv_cache_update(self, layer: Any, key: Any, value: Any, kv_cache: Any, slot_mapping: Any) -> None:
        k_cache, v_cache = self._views(kv_cache)
        blocks, offsets = slot_mapping // k_cache.shape[1], slot_mapping % k_cache.shape[1]
        k_cache[blocks, offsets] = key
        v_cache[blocks, offsets] = value


class FakeCpuAttnBackend:
    """FAKE vLLM 0.32 CPU_ATTN (x86 "vec" kernel): see `cpu_vec_views`."""

    views = staticmethod(cpu_vec_views)

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"


class FakeFlashAttnBackend:
    """FAKE vLLM 0.32 FLASH_ATTN: K and V side by side on the page's last axis."""

    views = staticmethod(kv_last_views)

    @staticmethod
    def get_name() -> str:
        return "FLASH_ATTN"


class FakeLegacyFlashAttnBackend:
    """FAKE FLASH_ATTN of vLLM releases that declared a 5-D shape: [2, blocks, block_size, heads, dim]."""

    @staticmethod
    def get_name() -> str:
        return "FLASH_ATTN"

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)


class FakeLegacyFlashInferBackend:
    """FAKE FLASHINFER of those releases: [blocks, 2, block_size, heads, dim]."""

    @staticmethod
    def get_name() -> str:
        return "FLASHINFER"

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        return (num_blocks, 2, block_size, num_kv_heads, head_size)


class FakeLegacyHeadMajorBackend:
    """FAKE head-major backend of those releases: [2, blocks, heads, block_size, dim]."""

    @staticmethod
    def get_name() -> str:
        return "FAKE_HEAD_MAJOR"

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        return (2, num_blocks, num_kv_heads, block_size, head_size)


# the backend behind each layout the fake engine plays ("cpu_vec": a probed page, the rest views)
FAKE_BACKENDS = {"cpu_vec": FakeCpuAttnBackend, "kv_last": FakeFlashAttnBackend, "nhd": FakeLegacyFlashAttnBackend,
                 "flashinfer": FakeLegacyFlashInferBackend, "hnd": FakeLegacyHeadMajorBackend}


class FakeAttentionLayer:
    """FAKE vLLM Attention layer, as registered in the static forward context."""

    def __init__(self, backend: type):
        self.backend = backend
        views = getattr(backend, "views", None)
        self.impl = FakeAttentionImpl(views) if views is not None else None

    def get_attn_backend(self) -> type:
        return self.backend


@dataclass
class FakeCompilationConfig:
    """FAKE stand-in for vLLM's CompilationConfig: the model's layers register here by name."""

    static_forward_context: dict[str, Any] = field(default_factory=dict)


@dataclass
class FakeVllmConfig:
    """FAKE stand-in for vLLM's VllmConfig (only the sub-configs the connector reads)."""

    model_config: FakeModelConfig = field(default_factory=FakeModelConfig)
    cache_config: FakeCacheConfig = field(default_factory=FakeCacheConfig)
    parallel_config: FakeParallelConfig = field(default_factory=FakeParallelConfig)
    compilation_config: FakeCompilationConfig = field(default_factory=FakeCompilationConfig)
    kv_transfer_config: FakeKVTransferConfig | None = field(default_factory=FakeKVTransferConfig)
