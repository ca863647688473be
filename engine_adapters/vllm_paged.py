"""The adapter contract (`engine_adapters.base.EngineAdapter`) for vLLM-style paged KV caches.

The connector (`engine_adapters.vllm`) is what vLLM itself calls, and it cannot be an
`EngineAdapter`: vLLM splits the work between a scheduler process and worker processes, and its
scheduler owns block allocation, so there is no single `load(token_ids) -> KV` call to make.
`PagedAdapter` gives the same paged layouts the contract (full chunks, tails, handles, events,
layer-wise forms), so they pass the shared conformance suite, and so a worker that keeps its KV
in vLLM's paged form can load a prefill worker's `KVHandle` straight into its blocks.

Engine format:
- whole-sequence KV is a `PagedKV`: one paged tensor per layer in a vLLM layout
  (`vllm_layout.PAGED_LAYOUTS`) plus the sequence's block table;
- one layer (layer-wise forms) is K and V as `[num_tokens, kv_heads, head_dim]`, the form vLLM's
  attention receives new keys and values in.
Chunk objects are the same as the connector's: a vLLM worker, this adapter and the HF adapter
read each other's chunks under one namespace.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from engine_adapters.base import (BackgroundLayerwiseLoad, ChunkStore, ChunkStoreAdapter, LoadResult,
                                  PlannedLayerwiseSave, PlannedObject, SaveResult)
from kvpool.handle import KVHandle
from engine_adapters.vllm_layout import PAGED_LAYOUTS, TORCH_DTYPES, paged_kv_views
from kvpool.api import PoolClient
from kvpool.errors import InvalidArgument
from kvpool.keys import Namespace
from kvpool.layout import HEADER_SIZE, ChunkView, KVLayout


@dataclass
class PagedKV:
    """KV of one sequence in paged form: token t lives in block `block_ids[t // block_size]`."""

    layers: list[torch.Tensor]
    block_ids: list[int]
    num_tokens: int
    block_size: int
    paged_layout: str = "kv_last"

    def _slots(self, start: int, end: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= start <= end <= self.num_tokens:
            raise InvalidArgument(f"tokens {start}..{end} outside this sequence of {self.num_tokens}")
        pos = torch.arange(start, end)
        blocks = torch.tensor(self.block_ids, dtype=torch.long)[pos // self.block_size]
        return blocks.to(device), (pos % self.block_size).to(device)

    def layer_tokens(self, i: int, start: int = 0, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of layer i for tokens [start, end) as `[tokens, kv_heads, head_dim]` (copies)."""
        k, v = paged_kv_views(self.layers[i], self.paged_layout)
        blocks, offs = self._slots(start, self.num_tokens if end is None else end, k.device)
        return k[blocks, offs], v[blocks, offs]

    def write_tokens(self, i: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write `[tokens, kv_heads, head_dim]` K and V of layer i at tokens start.. (in place)."""
        kc, vc = paged_kv_views(self.layers[i], self.paged_layout)
        blocks, offs = self._slots(start, start + k.shape[0], kc.device)
        kc[blocks, offs] = k.to(kc.device)
        vc[blocks, offs] = v.to(vc.device)


def new_paged_kv(layout: KVLayout, num_tokens: int, block_size: int, paged_layout: str = "kv_last",
                 block_ids: Sequence[int] | None = None, device: str = "cpu") -> PagedKV:
    """A zeroed paged cache just big enough for `block_ids` (default: blocks 0, 1, ...)."""
    need = -(-num_tokens // block_size)
    ids = list(range(need)) if block_ids is None else list(block_ids)
    if len(ids) < need:
        raise InvalidArgument(f"{num_tokens} tokens need {need} blocks, got {len(ids)}")
    nb, h, d = (max(ids) + 1 if ids else 0), layout.kv_heads, layout.head_dim
    shape = {"kv_last": (nb, h, block_size, 2 * d), "kv_rows": (nb, h, block_size, 2 * d),
             "nhd": (2, nb, block_size, h, d), "flashinfer": (nb, 2, block_size, h, d),
             "hnd": (2, nb, h, block_size, d)}[paged_layout]
    layers = [torch.zeros(shape, dtype=TORCH_DTYPES[layout.dtype], device=device) for _ in range(layout.num_layers)]
    return PagedKV(layers, ids, num_tokens, block_size, paged_layout)


def _payload(obj: PlannedObject, layout: KVLayout) -> torch.Tensor:
    """Writable `[layers, 2, kv_heads, tokens, head_dim]` view of a planned object's payload."""
    count = layout.payload_nbytes(obj.tokens) // layout.itemsize
    return torch.frombuffer(obj.buffer, dtype=TORCH_DTYPES[layout.dtype], count=count,
                            offset=HEADER_SIZE).view(layout.shape(obj.tokens))


class PagedLayerwiseSave(PlannedLayerwiseSave):
    """Copies each layer into the planned objects as it is handed over; `finish` seals and puts."""

    def __init__(self, adapter: PagedAdapter, token_ids: Sequence[int], request_id: str | None, start_token: int):
        self._adapter = adapter
        super().__init__(adapter.store, token_ids, request_id, start_token)

    def _payload(self, obj: PlannedObject) -> torch.Tensor:
        return _payload(obj, self._adapter.layout)

    def _copy_layer(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        for t in (k, v):
            self._adapter.check_layer(t, self.num_tokens)
        for obj, payload in zip(self.planned, self._payloads):
            payload[i, 0].copy_(k[obj.start:obj.start + obj.tokens].transpose(0, 1))
            payload[i, 1].copy_(v[obj.start:obj.start + obj.tokens].transpose(0, 1))


class PagedLayerwiseLoad(BackgroundLayerwiseLoad):
    """Fetches and verifies in a background thread, then fills the paged cache layer by layer."""

    def __init__(self, adapter: PagedAdapter, token_ids: Sequence[int], max_tokens: int | None,
                 into: PagedKV | None = None):
        self._adapter, self._into = adapter, into
        self._kv: PagedKV | None = None
        super().__init__(adapter.store, token_ids, max_tokens, thread_name="kvpool-paged-load")

    def _prepare(self, views: list[ChunkView]) -> int:
        self._kv = self._adapter.prepare(sum(v.tokens for v in views), self._into)
        return self._kv.num_tokens

    def _fill_layer(self, i: int, views: list[ChunkView]) -> None:
        self._adapter.fill_layer(self._kv, i, views)

    def _layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._kv.layer_tokens(i)

    def _result(self) -> PagedKV:
        return self._kv


class PagedAdapter(ChunkStoreAdapter):
    """`EngineAdapter` over paged KV caches (see the module docstring for the engine format)."""

    def __init__(self, pool: PoolClient, namespace: Namespace, *, block_size: int = 16, paged_layout: str = "kv_last"):
        if paged_layout not in PAGED_LAYOUTS:
            raise InvalidArgument(f"paged_layout must be one of {PAGED_LAYOUTS}, got {paged_layout!r}")
        if block_size <= 0 or namespace.layout.chunk_tokens % block_size:
            raise InvalidArgument(f"block_size {block_size} must divide chunk_tokens {namespace.layout.chunk_tokens}")
        self.store = ChunkStore(pool, namespace)
        self.namespace, self.layout = namespace, namespace.layout
        self.block_size, self.paged_layout = block_size, paged_layout

    def empty_kv(self, num_tokens: int, block_ids: Sequence[int] | None = None) -> PagedKV:
        return new_paged_kv(self.layout, num_tokens, self.block_size, self.paged_layout, block_ids)

    def check_layer(self, t: Any, num_tokens: int) -> None:
        want = (self.layout.kv_heads, self.layout.head_dim)
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or tuple(t.shape[1:]) != want or t.shape[0] < num_tokens:
            raise InvalidArgument(f"layer K/V must be [>= {num_tokens}, {want[0]}, {want[1]}], got "
                                  f"{tuple(getattr(t, 'shape', ()))}")
        if t.dtype != TORCH_DTYPES[self.layout.dtype]:
            raise InvalidArgument(f"layer K/V dtype {t.dtype} differs from the layout's {self.layout.dtype}")

    def prepare(self, num_tokens: int, into: PagedKV | None) -> PagedKV:
        if into is None:
            return self.empty_kv(num_tokens)
        if into.num_tokens < num_tokens or len(into.layers) != self.layout.num_layers:
            raise InvalidArgument(f"target paged KV holds {into.num_tokens} tokens, {num_tokens} are loaded")
        return into

    def fill_layer(self, kv: PagedKV, i: int, views: list[ChunkView]) -> None:
        start = 0
        for view in views:
            src = view.as_torch()[i]  # [2, heads, tokens, dim]
            kv.write_tokens(i, start, src[0].transpose(0, 1), src[1].transpose(0, 1))
            start += view.tokens

    def _fill(self, views: list[ChunkView], into: PagedKV | None) -> PagedKV:
        kv = self.prepare(sum(v.tokens for v in views), into)
        for i in range(self.layout.num_layers):
            self.fill_layer(kv, i, views)
        return kv

    # -- the contract ----------------------------------------------------------------------

    def load(self, token_ids: Sequence[int], max_tokens: int | None = None, *, into: PagedKV | None = None) -> LoadResult:
        """The longest verified cached prefix, in fresh blocks or in `into`'s blocks."""
        views = self.store.fetch_prefix(token_ids, max_tokens)
        return LoadResult(0, None) if not views else LoadResult(sum(v.tokens for v in views), self._fill(views, into))

    def save(self, token_ids: Sequence[int], kv: PagedKV, *, request_id: str | None = None,
             start_token: int = 0) -> SaveResult:
        if not isinstance(kv, PagedKV) or len(kv.layers) != self.layout.num_layers:
            raise InvalidArgument("save takes a PagedKV with one paged tensor per layer")
        if kv.num_tokens < len(token_ids):
            raise InvalidArgument(f"the KV holds {kv.num_tokens} tokens, fewer than the {len(token_ids)} token ids")
        sv = self.start_save(token_ids, request_id=request_id, start_token=start_token)
        for i in range(self.layout.num_layers):
            sv.save_layer(i, *kv.layer_tokens(i, 0, len(token_ids)))
        return sv.finish()

    def start_load(self, token_ids: Sequence[int], max_tokens: int | None = None, *,
                   into: PagedKV | None = None) -> PagedLayerwiseLoad:
        return PagedLayerwiseLoad(self, token_ids, max_tokens, into)

    def start_save(self, token_ids: Sequence[int], *, request_id: str | None = None,
                   start_token: int = 0) -> PagedLayerwiseSave:
        return PagedLayerwiseSave(self, token_ids, request_id, start_token)

    def load_handle(self, handle: KVHandle, *, into: PagedKV | None = None) -> PagedKV:
        """Every object of the handle (all or nothing) as paged KV of `handle.num_tokens` tokens."""
        return self._fill(self.store.fetch_handle(handle), into)
