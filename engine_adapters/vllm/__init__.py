"""vLLM v1 KV connector that stores and loads KV cache through the kvpool.

Enable it in vLLM (see docs/vllm.md):

    vllm serve MODEL --block-size 32 --kv-transfer-config '{"kv_connector": "KVPoolConnector",
        "kv_connector_module_path": "engine_adapters.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvpool_address": "127.0.0.1:7600", "chunk_tokens": 256}}'

How it maps vLLM onto the pool:
- Keys are kvpool chunk keys (`kvpool.keys.chunk_keys`): the namespace hashes model id, weights
  fingerprint, KV layout, chunk size and TP rank; the chain covers full chunks of
  `chunk_tokens` prompt tokens. vLLM's block size must divide `chunk_tokens`.
- Values are kvpool chunk objects (`kvpool.chunk_format`, layer-major payload), so a vLLM worker and the
  HuggingFace reference workers read each other's chunks when their namespaces agree.

The parts, split as vLLM splits its own connectors:

    connector.py  KVPoolConnector: what vLLM instantiates; builds the side its role needs
    scheduler.py  SchedulerSide: lookups in the pool, the per-step plan, delayed frees
    metadata.py   LoadSpec / SaveSpec: the plan, scheduler -> workers, once per step
    worker.py     WorkerSide: fetch (the adapters' one chunk reader), scatter and gather blocks
    settings.py   ConnectorSettings: vLLM's config -> KVLayout and Namespace
    layouts.py    the paged layout of a layer's KV tensor, from vLLM's attention backend
    pages.py      whole-block reads and writes (strided views, or a page map probed from vLLM)
"""

from engine_adapters.vllm.connector import VLLM_AVAILABLE, KVPoolConnector
from engine_adapters.vllm.metadata import KVPoolConnectorMetadata, LoadSpec, SaveSpec

__all__ = ["KVPoolConnector", "KVPoolConnectorMetadata", "LoadSpec", "SaveSpec", "VLLM_AVAILABLE"]
