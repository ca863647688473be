"""How the vLLM connector sees vLLM's paged KV cache: its layers, their attention backend, and
the layout of one layer's KV tensor.

`attention_layers` finds the layers vLLM registered and their attention backend; `backend_paged_layout` names the view layout a backend declares (never guessed
from the tensor's shape or device alone), and `paged_kv_views` maps a layer's tensor in such a
layout onto K and V views of shape `[num_blocks, block_size, kv_heads, head_dim]`. Pages only the
backend's kernel can decode are probed in `pages.py`.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from kvpool.errors import InvalidArgument, LayoutMismatch

# Paged layouts of one layer's KV cache that strided views express (logical shapes; the physical
# stride order may differ, the views follow the strides):
# vLLM 0.32 (run in tests/engine_adapters/vllm_real) gives every backend the logical page
# `[num_blocks, kv_heads, block_size, C]` of `vllm.v1.kv_cache_layout`, C = 2 * head_dim, and the
# backend decides what C holds:
#   "kv_last"    K = [..., :head_dim], V = [..., head_dim:]  (FLASH_ATTN, FLASHINFER, TRITON_ATTN,
#                FLEX_ATTENTION split the page this way)
#   "kv_rows"    each (block, head) page read as [2 * block_size, head_dim]: K rows, then V rows,
#                token-major. CPU_ATTN splits its page this way, but its kernels keep K in their own
#                order (transposed on x86 "vec"), so for it the page is probed (pages.py)
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
    backend declares (`pages.resolve_block_io` probes the page first where it can).

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

