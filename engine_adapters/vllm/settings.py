"""What the vLLM connector reads from vLLM's config: `ConnectorSettings` maps the model, cache and
parallel configs and `--kv-transfer-config` (its `kv_connector_extra_config`) onto a kvpool
`KVLayout` and `Namespace`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine_adapters.chunk_store import plugin_tenant_salt
from engine_adapters.vllm.layouts import PAGED_LAYOUTS
from kvpool.chunk_format import KVLayout
from kvpool.security.keyring import request_salt
from kvpool.codec import get_codec
from kvpool.config import current_settings, default
from kvpool.errors import InvalidArgument
from kvpool.keys import Namespace

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_DTYPE_ALIASES = {"half": "float16", "float": "float32", "fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def _dtype_name(value: Any) -> str:
    name = str(value).removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in TORCH_DTYPES:
        raise InvalidArgument(f"KVPoolConnector supports float16, bfloat16 and float32 KV caches, got {value!r}")
    return name


@dataclass(frozen=True)
class ConnectorSettings:
    """What the connector reads from vLLM's config and `kv_connector_extra_config`."""

    block_size: int
    layout: KVLayout
    tp_size: int
    model_id: str
    weights_fingerprint: str
    tenant_salt: str = ""
    address: str = default("pool.master")
    kv_role: str = "kv_both"
    async_save: bool = False
    load_mode: str = "layerwise"  # or "sync": scatter every layer inside start_load_kv
    paged_layout: str = "auto"

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> ConnectorSettings:
        ktc = vllm_config.kv_transfer_config
        extra = dict(getattr(ktc, "kv_connector_extra_config", None) or {})
        model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
        block_size = int(cache.block_size)
        settings = current_settings()  # what kv_connector_extra_config leaves out
        chunk_tokens = int(extra.get("chunk_tokens", settings.pool.chunk_tokens))
        if chunk_tokens <= 0 or chunk_tokens % block_size:
            raise InvalidArgument(f"chunk_tokens ({chunk_tokens}) must be a positive multiple of vLLM's block size ({block_size})")
        cache_dtype = getattr(cache, "cache_dtype", "auto")
        dtype = _dtype_name(model.dtype if cache_dtype in (None, "auto") else cache_dtype)
        layout = KVLayout(
            num_layers=int(extra.get("num_layers", model.get_num_layers(parallel))),
            kv_heads=int(extra.get("kv_heads", model.get_num_kv_heads(parallel))),
            head_dim=int(extra.get("head_dim", model.get_head_size())),
            dtype=dtype,
            chunk_tokens=chunk_tokens,
            # how chunks are stored (kvpool.codec): part of the layout, so of the namespace; lossless by default
            codec=str(extra.get("kv_codec", settings.pool.kv_codec)),
        )
        get_codec(layout.codec)  # an unknown name is InvalidArgument at startup, not at the first save
        load_mode = extra.get("load_mode", "layerwise")
        paged_layout = extra.get("paged_layout", "auto")
        kv_role = getattr(ktc, "kv_role", None) or "kv_both"
        for name, value, allowed in (("load_mode", load_mode, ("layerwise", "sync")),
                                     ("paged_layout", paged_layout, ("auto", *PAGED_LAYOUTS)),
                                     ("kv_role", kv_role, ("kv_producer", "kv_consumer", "kv_both"))):
            if value not in allowed:
                raise InvalidArgument(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        return cls(
            block_size=block_size,
            layout=layout,
            tp_size=int(getattr(parallel, "tensor_parallel_size", 1)),
            model_id=str(extra.get("model_id", model.model)),
            weights_fingerprint=str(extra.get("weights_fingerprint", getattr(model, "revision", None)
                                              or settings.connector.weights_fingerprint)),
            tenant_salt=plugin_tenant_salt(extra),
            address=str(extra.get("kvpool_address", settings.pool.master)),
            kv_role=kv_role,
            async_save=bool(extra.get("async_save", False)),
            load_mode=load_mode,
            paged_layout=paged_layout,
        )

    @property
    def chunk_tokens(self) -> int:
        return self.layout.chunk_tokens

    @property
    def loads(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def saves(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    def namespace(self, tp_rank: int, cache_salt: str | None = None) -> Namespace:
        """The chunk key namespace of TP rank `tp_rank` for requests carrying `cache_salt` (vLLM's
        per-request salt, `Request.cache_salt`; None: the configured namespace, as before salts),
        salted with `kvpool.security.keyring.request_salt(tenant_salt, cache_salt)`."""
        return Namespace(self.model_id, self.weights_fingerprint, self.layout, tp_rank, self.tp_size,
                         request_salt(self.tenant_salt, cache_salt))
