"""FAKE SGLang host KV pool (`MHATokenToKVPoolHost` stand-in) for the HiCache backend tests.

A real CPU tensor `kv_buffer` in SGLang's host layouts, with the page methods SGLang's
HiCacheController calls on it; the index arithmetic follows SGLang's documented layouts:

    layer_first        [2, layers, size, heads, head_dim]
    page_first         [2, size, layers, heads, head_dim]
    page_first_direct  [2, size // page_size, layers, page_size, heads, head_dim]

A flat data page is the page's slice of `kv_buffer` flattened in that layout's order. Only the
slot allocator is left out (tests pick host indices themselves).
"""

from __future__ import annotations

import torch


class FakeMHATokenToKVPoolHost:
    """FAKE stand-in for SGLang's MHATokenToKVPoolHost (CPU only)."""

    def __init__(self, layer_num: int, head_num: int, head_dim: int, size: int, page_size: int,
                 layout: str = "page_first", dtype: torch.dtype = torch.float16):
        if size % page_size:
            raise ValueError("size must be a multiple of page_size")
        self.layer_num, self.head_num, self.head_dim = layer_num, head_num, head_dim
        self.size, self.page_size, self.layout, self.dtype = size, page_size, layout, dtype
        dims = {
            "layer_first": (2, layer_num, size, head_num, head_dim),
            "page_first": (2, size, layer_num, head_num, head_dim),
            "page_first_direct": (2, size // page_size, layer_num, page_size, head_num, head_dim),
        }[layout]
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def _page(self, index: int) -> torch.Tensor:
        index = int(index)
        if self.layout == "layer_first":
            return self.kv_buffer[:, :, index:index + self.page_size]
        if self.layout == "page_first":
            return self.kv_buffer[:, index:index + self.page_size]
        return self.kv_buffer[:, index // self.page_size:index // self.page_size + 1]

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self._page(index)
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(2 * self.layer_num * self.page_size * self.head_num * self.head_dim, dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        page = self._page(index)
        page.copy_(data_page.reshape(page.shape))

    def token_kv(self, index: int) -> torch.Tensor:
        """K and V of one token slot across layers: [layers, 2, heads, head_dim] (test helper)."""
        index = int(index)
        if self.layout == "layer_first":
            return self.kv_buffer[:, :, index].transpose(0, 1)
        if self.layout == "page_first":
            return self.kv_buffer[:, index].transpose(0, 1)
        p, o = divmod(index, self.page_size)
        return self.kv_buffer[:, p, :, o].transpose(0, 1)
