"""How the vLLM connector sees vLLM: its settings and its paged KV cache geometry.

`ConnectorSettings` maps vLLM's config (model, cache, parallel, `--kv-transfer-config`) onto a
kvpool `KVLayout` and `Namespace`. `attention_layers` finds the layers vLLM registered and their
attention backend; `backend_paged_layout` names the view layout a backend declares (never guessed
from the tensor's shape or device alone), and `paged_kv_views` maps a layer's tensor in such a
layout onto K and V views of shape `[num_blocks, block_size, kv_heads, head_dim]`. Pages only the
backend's kernel can decode are probed in `vllm_pages.py`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from kvpool.errors import InvalidArgument, LayoutMismatch
from kvpool.keys import Namespace
from kvpool.layout import KVLayout

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_DTYPE_ALIASES = {"half": "float16", "float": "float32", "fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}

# Paged layouts of one layer's KV cache that strided views express (logical shapes; the physical
# stride order may differ, the views follow the strides):
# vLLM 0.32 (run in tests/engine_adapters/vllm_real) gives every backend the logical page
# `[num_blocks, kv_heads, block_size, C]` of `vllm.v1.kv_cache_layout`, C = 2 * head_dim, and the
# backend decides what C holds:
#   "kv_last"    K = [..., :head_dim], V = [..., head_dim:]  (FLASH_ATTN, FLASHINFER, TRITON_ATTN,
#                FLEX_ATTENTION split the page this way)
#   "kv_rows"    each (block, head) page read as [2 * block_size, head_dim]: K rows, then V rows,
#                token-major. CPU_ATTN splits its page this way, but its kernels keep K in their own
#                order (transposed on x86 "vec"), so for it the page is probed (vllm_pages.py)
# Older vLLM, whose backends declare `get_kv_cache_shape(num_blocks, block_size, heads, dim)`:
#   "nhd"        [2, num_blocks, block_size, kv_heads, head_dim]   FlashAttention
#   "flashinfer" [num_blocks, 2, block_size, kv_heads, head_dim]   FlashInfer
#   "hnd"        [2, num_blocks, kv_heads, block_size, head_dim]   head-major, where a backend declares it
# A (K, V) pair of [num_blocks, block_size, kv_heads, head_dim] tensors is accepted as well.
PAGED_LAYOUTS = ("kv_last", "kv_rows", "nhd", "flashinfer", "hnd")
# How the vLLM 0.32 GPU backends split the content axis of their page: used where the page cannot
# be probed (the layer exposes no `impl.do_kv_cache_update`). CPU_ATTN is not here: its K order
# depends on the kernel ISA, so it is always probed.
PAGE_CONTENT_SPLIT = {"FLASH_ATTN": "kv_last", "FLASHINFER": "kv_last", "TRITON_ATTN": "kv_last",
                      "FLEX_ATTENTION": "kv_last"}
_PROBE_BLOCKS = 1009  # a num_blocks no real dimension equals: finds the block axis in a declared shape


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
    address: str = "127.0.0.1:7600"
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
        chunk_tokens = int(extra.get("chunk_tokens", 256))
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
        )
        load_mode = extra.get("load_mode", "layerwise")
        if load_mode not in ("layerwise", "sync"):
            raise InvalidArgument(f"load_mode must be 'layerwise' or 'sync', got {load_mode!r}")
        paged_layout = extra.get("paged_layout", "auto")
        if paged_layout not in ("auto", *PAGED_LAYOUTS):
            raise InvalidArgument(f"paged_layout must be 'auto' or one of {PAGED_LAYOUTS}, got {paged_layout!r}")
        kv_role = getattr(ktc, "kv_role", None) or "kv_both"
        if kv_role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise InvalidArgument(f"kv_role must be kv_producer, kv_consumer or kv_both, got {kv_role!r}")
        return cls(
            block_size=block_size,
            layout=layout,
            tp_size=int(getattr(parallel, "tensor_parallel_size", 1)),
            model_id=str(extra.get("model_id", model.model)),
            weights_fingerprint=str(extra.get("weights_fingerprint", getattr(model, "revision", None) or "unversioned")),
            tenant_salt=str(extra.get("tenant_salt", "")),
            address=str(extra.get("kvpool_address", os.environ.get("KVPOOL_MASTER", "127.0.0.1:7600"))),
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

    def namespace(self, tp_rank: int) -> Namespace:
        return Namespace(self.model_id, self.weights_fingerprint, self.layout, tp_rank, self.tp_size, self.tenant_salt)


def attention_layers(vllm_config: Any, layer_names: Iterable[str]) -> dict[str, Any]:
    """The attention layer objects vLLM registered under these names (its static forward context,
    filled when the model is built), with their attention backend; unknown names are left out."""
    ctx = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None) or {}
    return {name: ctx[name] for name in layer_names if layer_backend(ctx.get(name)) is not None}


def layer_backend(layer: Any) -> Any:
    """The attention backend class of a registered layer (None if it names none)."""
    getter = getattr(layer, "get_attn_backend", None)
    return getter() if callable(getter) else getattr(layer, "attn_backend", None)


def backend_paged_layout(backend: Any, block_size: int, kv_heads: int, head_dim: int) -> str:
    """The view layout (see PAGED_LAYOUTS) of a vLLM attention backend's KV cache, from what the
    backend declares (`vllm_pages.resolve_block_io` probes the page first where it can).

    A backend that declares its shape (`get_kv_cache_shape`, older vLLM) is asked for it with a
    num_blocks and a head count no other dimension equals, which pins every axis; a backend of
    vLLM's logical [blocks, heads, block_size, 2 * head_dim] page (no such method) is looked up
    in PAGE_CONTENT_SPLIT. Anything else is refused with the backend's name.
    """
    name = str(backend.get_name())
    declare = getattr(backend, "get_kv_cache_shape", None)
    if declare is None:
        if name not in PAGE_CONTENT_SPLIT:
            raise InvalidArgument(f"KVPoolConnector does not know how vLLM's attention backend {name} lays out K and V "
                                  f"in its KV cache page (known: {', '.join(sorted(PAGE_CONTENT_SPLIT))}); "
                                  "MLA and quantized KV caches are not supported")
        return PAGE_CONTENT_SPLIT[name]
    heads = next(h for h in (3, 5, 7, 11, 13) if h not in (block_size, head_dim))
    try:
        shape = tuple(int(x) for x in declare(_PROBE_BLOCKS, block_size, heads, head_dim))
    except Exception as exc:  # noqa: BLE001 - the backend's own check, reported with its name
        raise InvalidArgument(f"vLLM attention backend {name} refused get_kv_cache_shape: {exc}") from exc
    nb = _PROBE_BLOCKS
    for layout, expect in (("nhd", (2, nb, block_size, heads, head_dim)), ("flashinfer", (nb, 2, block_size, heads, head_dim)),
                           ("hnd", (2, nb, heads, block_size, head_dim))):
        if shape == expect:
            return layout
    raise InvalidArgument(f"vLLM attention backend {name} declares a KV cache of shape {shape} for num_blocks={nb}, "
                          f"block_size={block_size}, kv_heads={heads}, head_dim={head_dim}: not a layout KVPoolConnector "
                          "supports (MLA caches are not)")


def paged_kv_views(kv_layer: Any, layout_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer as views of shape [num_blocks, block_size, kv_heads, head_dim].

    Views, not copies: indexed assignment into them writes vLLM's paged buffer in place. With
    kernel blocks (vLLM splits a block into `ratio` kernel blocks) the leading two axes are
    [num_blocks * ratio, block_size // ratio].
    """
    if isinstance(kv_layer, (tuple, list)):
        return kv_layer[0], kv_layer[1]
    if layout_name == "nhd":
        return kv_layer[0], kv_layer[1]
    if layout_name == "flashinfer":
        return kv_layer[:, 0], kv_layer[:, 1]
    if layout_name == "hnd":
        return kv_layer[0].transpose(1, 2), kv_layer[1].transpose(1, 2)
    if layout_name in ("kv_last", "kv_rows"):
        if kv_layer.dim() != 4 or kv_layer.shape[-1] % 2:
            raise LayoutMismatch(f"a {layout_name} KV cache is [blocks, heads, block_size, 2 * head_dim], got {tuple(kv_layer.shape)}")
        blocks, heads, tokens, content = kv_layer.shape
        if layout_name == "kv_last":
            pages = kv_layer.transpose(1, 2)
            return pages[..., : content // 2], pages[..., content // 2:]
        if kv_layer.stride(-1) != 1 or kv_layer.stride(-2) != content:
            raise LayoutMismatch(f"a kv_rows KV cache needs each [block_size, 2 * head_dim] page contiguous, got strides "
                                 f"{kv_layer.stride()} for shape {tuple(kv_layer.shape)}")
        rows = kv_layer.view(blocks, heads, 2, tokens, content // 2)
        return rows[:, :, 0].transpose(1, 2), rows[:, :, 1].transpose(1, 2)
    raise InvalidArgument(f"unknown paged layout {layout_name!r}")

