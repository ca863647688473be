"""Whole-block reads and writes of one layer's paged KV cache, whatever its layout.

The connector moves KV in whole (kernel) blocks: `read(kv_layer, idx)` returns K and V of the
blocks `idx` as `[len(idx), block_size, kv_heads, head_dim]` copies, `write` puts them in place.
Two kinds:
- `ViewIO`: a layout that strided views express (`layouts.PAGED_LAYOUTS`);
- `PageMapIO`: a page whose element order only the backend's kernel knows. vLLM 0.32's CPU_ATTN
  splits its `[block_size, 2 * head_dim]` page into K rows then V rows, and its x86 "vec" kernel
  keeps the K half transposed (`[head_dim, block_size]`); other ISAs (AMX, NEON, ...) tile it
  their own way. So the map is probed (`probe_page_map`): the layer's own cache-write path
  (`impl.do_kv_cache_update`, what vLLM runs before attention) writes digit-coded K and V into a
  one-block scratch page, and each page element then tells which (K or V, token, head, dim) it
  holds. The map must cover every K and V element exactly once (elements nothing writes, such as
  padding, are allowed), or the layout is refused.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from engine_adapters.vllm.layouts import backend_paged_layout, layer_backend, paged_kv_views
from kvpool.errors import LayoutMismatch

_DIGIT_BASE = 16  # probe values 0..15 are exact in every supported dtype (bf16 holds integers to 256)


class ViewIO:
    """Blocks of a layout that strided views express (indexed assignment writes in place)."""

    def __init__(self, name: str):
        self.name = name

    def block_shape(self, kv_layer: Any) -> tuple[int, ...]:
        """[block_tokens, kv_heads, head_dim] of one (kernel) block."""
        return tuple(paged_kv_views(kv_layer, self.name)[0].shape[1:])

    def read(self, kv_layer: Any, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = paged_kv_views(kv_layer, self.name)
        return k[idx], v[idx]

    def write(self, kv_layer: Any, idx: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        k_cache, v_cache = paged_kv_views(kv_layer, self.name)
        k_cache[idx] = k
        v_cache[idx] = v


class PageMapIO:
    """Blocks of a `[blocks, *page]` tensor whose page element order was probed.

    `positions[s]` is the page element (flat, logical order) that holds source element s of
    `[2 (K, V), block_tokens, kv_heads, head_dim]`.
    """

    def __init__(self, name: str, positions: torch.Tensor, page_shape: Sequence[int], block_shape: Sequence[int]):
        self.name = name
        self.page_shape, self._block_shape = tuple(page_shape), tuple(block_shape)
        self._positions = {positions.device: positions}
        self._covers_page = positions.numel() == math.prod(self.page_shape)

    def block_shape(self, kv_layer: Any) -> tuple[int, ...]:
        return self._block_shape

    def _on(self, device: torch.device) -> torch.Tensor:
        if device not in self._positions:
            self._positions[device] = next(iter(self._positions.values())).to(device)
        return self._positions[device]

    def read(self, kv_layer: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pages = kv_layer[idx].reshape(len(idx), -1)
        src = pages[:, self._on(pages.device)].view(len(idx), 2, *self._block_shape)
        return src[:, 0], src[:, 1]

    def write(self, kv_layer: torch.Tensor, idx: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        n = len(idx)
        # a page with elements nothing maps (padding) keeps them: read-modify-write
        pages = (torch.empty(n, math.prod(self.page_shape), dtype=kv_layer.dtype, device=kv_layer.device)
                 if self._covers_page else kv_layer[idx].reshape(n, -1))
        pages[:, self._on(pages.device)] = torch.stack((k, v), dim=1).reshape(n, -1).to(pages.dtype)
        kv_layer[idx] = pages.view(n, *self.page_shape)


def probe_page_map(write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None],
                   page_shape: Sequence[int], block_shape: Sequence[int], dtype: torch.dtype,
                   device: torch.device | str, what: str) -> PageMapIO:
    """Probe a page's element order through `write(key, value, scratch, slot_mapping)`.

    `write` must store `key`/`value` (`[block_tokens, kv_heads, head_dim]`) into the slots of the
    one-block `scratch` (`[1, *page_shape]`) the way the engine does; `what` names it in errors.
    """
    tokens, heads, dim = block_shape
    sources = 2 * tokens * heads * dim
    page = math.prod(page_shape)
    source_ids = torch.arange(sources, device=device).view(2, tokens, heads, dim)
    decoded = torch.zeros(page, dtype=torch.long, device=device)
    written = torch.ones(page, dtype=torch.bool, device=device)
    slots = torch.arange(tokens, dtype=torch.long, device=device)
    for place in range(max(1, math.ceil(math.log(sources, _DIGIT_BASE)))):
        digit = (source_ids // _DIGIT_BASE ** place) % _DIGIT_BASE
        scratch = torch.full((1, *page_shape), -1, dtype=dtype, device=device)
        write(digit[0].to(dtype).contiguous(), digit[1].to(dtype).contiguous(), scratch, slots)
        got = scratch.reshape(-1).to(torch.long)
        written &= got >= 0
        decoded += got.clamp(min=0) * _DIGIT_BASE ** place
    used = written.nonzero().flatten()
    found = decoded[used]
    if len(used) != sources or not torch.equal(torch.sort(found).values, torch.arange(sources, device=device)):
        raise LayoutMismatch(f"{what} does not store each K and V element of a block exactly once in its page "
                             f"(shape {tuple(page_shape)}): not a layout KVPoolConnector can move")
    positions = torch.empty(sources, dtype=torch.long, device=device)
    positions[found] = used
    return PageMapIO(_name_of(positions, tokens, heads, dim), positions, page_shape, block_shape)


def _name_of(positions: torch.Tensor, tokens: int, heads: int, dim: int) -> str:
    """The view layout a probed map equals, if any (for logs), else "probed"."""
    page = torch.arange(heads * tokens * 2 * dim, device=positions.device).view(1, heads, tokens, 2 * dim)
    for name in ("kv_last", "kv_rows"):
        k, v = paged_kv_views(page, name)
        if torch.equal(torch.stack((k[0], v[0])).flatten(), positions):
            return name
    return "probed"


def resolve_block_io(layer: Any, kv_layer: Any, block_size: int, kv_heads: int, head_dim: int) -> ViewIO | PageMapIO:
    """How to move whole blocks of this layer, from vLLM itself: the page probed through the
    layer's cache-write path where vLLM's logical [blocks, heads, block_tokens, 2 * head_dim]
    page has one, else the view layout its backend declares (refused with the backend's name)."""
    backend = layer_backend(layer)
    name = str(backend.get_name())
    update = getattr(getattr(layer, "impl", None), "do_kv_cache_update", None)
    if getattr(backend, "get_kv_cache_shape", None) is None and callable(update) and isinstance(kv_layer, torch.Tensor):
        if kv_layer.dim() != 4:
            raise LayoutMismatch(f"vLLM attention backend {name}: KV cache of shape {tuple(kv_layer.shape)} is not "
                                 "vLLM's [blocks, heads, block_tokens, content] page (MLA caches are not supported)")
        page_shape = tuple(kv_layer.shape[1:])
        return probe_page_map(lambda k, v, cache, slots: update(layer, k, v, cache, slots), page_shape,
                              (page_shape[1], kv_heads, head_dim), kv_layer.dtype, kv_layer.device,
                              f"vLLM attention backend {name}")
    if name == "CPU_ATTN":
        raise LayoutMismatch("vLLM attention backend CPU_ATTN orders K inside its pages by kernel ISA: the connector "
                             "probes it through the layer's impl.do_kv_cache_update, which this layer lacks")
    return ViewIO(backend_paged_layout(backend, block_size, kv_heads, head_dim))


def kernel_block_ids(block_ids: Sequence[int], ratio: int) -> list[int]:
    """The kernel blocks of vLLM blocks when each block is `ratio` kernel blocks (ratio 1: the same)."""
    if ratio == 1:
        return list(block_ids)
    return [b * ratio + j for b in block_ids for j in range(ratio)]
