"""LMCache engines on CPU, for `kvpool bench lmcache` and the LMCache plugin's tests.

LMCache 0.5 moves KV between an engine and its chunks through a "GPU connector"; it ships them
for CUDA, XPU, MUSA and HPU only (`CreateGPUConnector` raises "No supported cpu connector found"
on a CPU-only machine). `CPUKVConnector` is that interface over a CPU tensor in LMCache's own
chunk format, `[2, layers, tokens, kv heads * head dim]`, passed as `kvcaches=` to `store` and
`retrieve`: LMCache's engine, token hashing, storage manager and backends run unchanged around it.
Needs the `lmcache` package (imported here at module import).
"""

from __future__ import annotations

from typing import Any

import torch
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.metadata import LMCacheMetadata

# SmolLM2-135M (the reference model): 30 layers, 3 KV heads of 64; bfloat16 as vLLM serves it
SMOLLM2 = {"layers": 30, "kv_heads": 3, "head_dim": 64}
KVPOOL_PLUGIN = {"remote_storage_plugin.kvpool.module_path": "engine_adapters.lmcache",
                 "remote_storage_plugin.kvpool.class_name": "KVPoolConnectorAdapter"}


class CPUKVConnector(GPUConnectorInterface):
    """LMCache's GPU-connector interface over a CPU KV tensor (`kvcaches=`, `[2, L, tokens, H*D]`)."""

    def __init__(self, metadata: LMCacheMetadata):
        layers, _, _, heads, head_dim = metadata.kv_shape
        self.layers, self.hidden = layers, heads * head_dim

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.layers, num_tokens, self.hidden])

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        memory_obj.tensor.copy_(kwargs["kvcaches"][:, :, start:end])

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        kwargs["kvcaches"][:, :, start:end].copy_(memory_obj.tensor)

    def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends):
            self.from_gpu(obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs: Any = None, starts: Any = None, ends: Any = None, **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends):
            self.to_gpu(obj, start, end, **kwargs)


def metadata(model: str = "HuggingFaceTB/SmolLM2-135M-Instruct", chunk: int = 256, dtype: torch.dtype = torch.bfloat16,
             layers: int = SMOLLM2["layers"], kv_heads: int = SMOLLM2["kv_heads"], head_dim: int = SMOLLM2["head_dim"],
             role: str = "worker") -> LMCacheMetadata:
    return LMCacheMetadata(model_name=model, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                           kv_dtype=dtype, kv_shape=(layers, 2, chunk, kv_heads, head_dim), chunk_size=chunk, role=role)


def config(instance: str, *, cpu_gb: float = 0.5, chunk: int = 256, kvpool_url: str | None = None,
           redis_url: str | None = None, local_cpu: bool = True, **extra: Any) -> LMCacheEngineConfig:
    """An LMCache config with its local CPU tier and at most one remote plugin (kvpool or redis)."""
    plugins, extra_config = [], dict(extra)
    if kvpool_url is not None:
        plugins.append("kvpool")
        extra_config.update(KVPOOL_PLUGIN)
        extra_config["remote_storage_plugin.kvpool.url"] = kvpool_url
    if redis_url is not None:
        plugins.append("redis")
        extra_config["remote_storage_plugin.redis.redis_url"] = redis_url
    return LMCacheEngineConfig.from_defaults(chunk_size=chunk, local_cpu=local_cpu, max_local_cpu_size=cpu_gb,
                                             lmcache_instance_id=instance, remote_storage_plugins=plugins or None,
                                             extra_config=extra_config or None)


def engine(instance: str, cfg: LMCacheEngineConfig, md: LMCacheMetadata) -> LMCacheEngine:
    """An LMCache engine with the CPU connector, its storage manager started."""
    eng = LMCacheEngineBuilder.get_or_create(instance, cfg, md, CPUKVConnector(md), lambda t, r: None, lambda o, r: o)
    eng.post_init()
    return eng


def close(instance: str) -> None:
    LMCacheEngineBuilder.destroy(instance)
