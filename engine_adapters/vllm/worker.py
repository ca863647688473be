"""The connector's worker side (each vLLM worker process): moves KV between vLLM's paged blocks
and the pool's chunk objects, as the step's metadata (`metadata.py`) says.

- `register_kv_caches` learns each layer's paged layout from vLLM's attention backend
  (`pages.resolve_block_io`), checked against the configured layout.
- `start_load_kv` fetches and verifies the chunks of every `LoadSpec` through the adapters' one
  reader (`engine_adapters.chunk_reader`); `wait_for_layer_load` scatters one layer into the
  paged blocks (the payload is layer-major, so layer i needs only its own slice).
- `save_kv_layer` copies one layer of the chunks being saved straight into the payloads of their
  chunk objects; `wait_for_save` seals them and writes them with one `put_batch` (through
  `engine_adapters.chunk_store.ChunkStore`, which also emits "stored" events).

Invariants:
- A chunk that is missing, fails its checksum or has another layout is a miss: nothing of it or
  of later chunks is written to the paged cache, and every block of the request's load range
  from that chunk on is reported by `get_block_ids_with_load_errors` (vLLM then recomputes them
  with `"kv_load_failure_policy": "recompute"`; its default, "fail", fails the request).
  A chunk that names another namespace or key, or fails its MAC (with a keyring), is a miss too;
  whether the reader also removes it (a "removed" event, so a later save replaces it) is the
  reader's rule (`engine_adapters.chunk_reader`: only our own damaged chunks, only unkeyed).
- A loaded request whose layers were not all scattered before their attention ran (hooks
  skipped) computed on missing KV: its loaded blocks are reported as load errors.
- Saves copy the KV out of the paged buffer before `wait_for_save` returns, so vLLM may reuse the
  blocks afterwards. With `async_save`, the pool writes finish in the background, and
  `get_finished` reports each request that had saves (and only those) once the scheduler
  finished it and all its writes ended.
- A spec's chunks are keyed, written and verified in the namespace of its `cache_salt`
  (`ConnectorSettings.namespace`), through that namespace's `ChunkStore`: a chunk of another
  salt's namespace is a miss, like any other namespace's.
- A pool error never fails a request: failed loads are misses, failed saves are logged.
"""

from __future__ import annotations

import logging
import re
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

import torch

from engine_adapters.chunk_store import ChunkStore, PlannedObject, plugin_mac_key
from engine_adapters.vllm.layouts import attention_layers, layer_backend
from engine_adapters.vllm.metadata import KVPoolConnectorMetadata, LoadSpec, SaveSpec
from engine_adapters.vllm.pages import PageMapIO, ViewIO, kernel_block_ids, resolve_block_io
from engine_adapters.vllm.settings import TORCH_DTYPES, ConnectorSettings
from kvpool.chunk_format import payload_tensor
from kvpool.contract import PoolClient
from kvpool.errors import InvalidArgument, KVPoolError, LayoutMismatch

logger = logging.getLogger(__name__)

MAX_SALTED_STORES = 256  # ChunkStores of salted namespaces kept (one per cache_salt seen; oldest dropped)


@dataclass
class _ActiveLoad:
    spec: LoadSpec
    chunks: list[torch.Tensor | None]  # by chunk index; verified payloads [layers, 2, heads, chunk, dim]
    end: int  # tokens [spec.start, end) are loadable


@dataclass
class _ActiveSave:
    spec: SaveSpec
    store: ChunkStore  # of spec.cache_salt's namespace
    keys: list[str]  # every full-chunk key of spec.token_ids
    planned: list[PlannedObject]  # chunk objects being filled in place, layer by layer
    payloads: list[torch.Tensor]  # per planned object, its payload as [layers, 2, heads, chunk, dim]


class WorkerSide:
    """The worker-role half of `KVPoolConnector` (one per worker process and TP rank)."""

    def __init__(self, settings: ConnectorSettings, vllm_config: Any, pool: Callable[[], PoolClient], tp_rank: int):
        self.settings = settings
        self._vllm_config = vllm_config
        self._pool = pool
        self._tp_rank = tp_rank
        self._store: ChunkStore | None = None
        self._salted: dict[str, ChunkStore] = {}  # cache_salt -> the ChunkStore of its namespace
        self._listeners: list[Callable[[Any], None]] = []
        self._layers: dict[str, int] = {}  # layer name -> index into the chunk payload
        self._kv_caches: dict[str, Any] = {}
        self._io: ViewIO | PageMapIO | None = None  # how whole blocks of every layer are read and written
        self._kernel_ratio = 1  # vLLM kernel blocks per block (the registered tensors are kernel-block granular)
        self._step_meta: KVPoolConnectorMetadata | None = None
        self._active_loads: list[_ActiveLoad] = []
        self._active_saves: list[_ActiveSave] = []
        self._loaded_layers: set[str] = set()
        self._load_errors: set[int] = set()
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: dict[str, list[Future]] = {}  # req id -> pending async saves
        self._saving_reqs: set[str] = set()  # req ids that had saves (async mode) not yet reported
        self._finished_reqs: set[str] = set()
        self.stats = {"loaded_chunks": 0, "load_errors": 0, "saved_chunks": 0, "save_errors": 0}

    @property
    def store(self) -> ChunkStore:
        """The adapters' engine-free half: keys, the one chunk reader, writes, events."""
        if self._store is None:
            self._store = self._make_store(None)
        return self._store

    def store_for(self, cache_salt: str | None) -> ChunkStore:
        """The ChunkStore of requests carrying `cache_salt` (None: `store`)."""
        if not cache_salt:
            return self.store
        found = self._salted.get(cache_salt)
        if found is None:
            if len(self._salted) >= MAX_SALTED_STORES:
                self._salted.pop(next(iter(self._salted)))
            found = self._salted[cache_salt] = self._make_store(cache_salt)
        return found

    def _make_store(self, cache_salt: str | None) -> ChunkStore:
        store = ChunkStore(self._pool(), self.settings.namespace(self._tp_rank, cache_salt), mac_key=self._mac_key)
        for callback in self._listeners:
            store.add_listener(callback)
        return store

    @cached_property
    def _mac_key(self) -> bytes | None:
        """With a keyring, chunks (of every namespace) are MACed under the key of the principal the
        pool client runs as."""
        return plugin_mac_key()

    def add_listener(self, callback: Callable[[Any], None]) -> None:
        """KVEvent callbacks of every namespace's store, present and future."""
        self._listeners.append(callback)
        for store in (self.store, *self._salted.values()):
            store.add_listener(callback)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Record the layers (in model order) and how to move their blocks, as vLLM's attention
        backend says (`paged_layout` in the extra config overrides), checked against the config."""
        layout, block = self.settings.layout, self.settings.block_size
        if len(kv_caches) != layout.num_layers:
            raise LayoutMismatch(f"vLLM registered {len(kv_caches)} KV layers, the model config says {layout.num_layers}")
        names = list(kv_caches)
        if all(re.search(r"\d+", n) for n in names):  # "model.layers.7.attn": order by layer number
            names.sort(key=lambda n: [int(x) for x in re.findall(r"\d+", n)])
        layers = attention_layers(self._vllm_config, names)
        backends = {layer_backend(layer).get_name() for layer in layers.values()}
        if len(backends) > 1:
            raise LayoutMismatch(f"the KV layers use several attention backends ({', '.join(sorted(backends))}): "
                                 "KVPoolConnector supports one KV cache group")
        backend_name = next(iter(backends), "unknown")
        first = kv_caches[names[0]]
        if self.settings.paged_layout != "auto" or isinstance(first, (tuple, list)):
            self._io = ViewIO(self.settings.paged_layout)
        elif not layers:
            raise LayoutMismatch("vLLM did not say which attention backend its layers use (no layer in the static "
                                 "forward context): set paged_layout in kv_connector_extra_config")
        else:
            self._io = resolve_block_io(layers.get(names[0], next(iter(layers.values()))), first, block,
                                        layout.kv_heads, layout.head_dim)
        for i, name in enumerate(names):
            kv = kv_caches[name]
            head = kv[0] if isinstance(kv, (tuple, list)) else kv
            if head.dtype != TORCH_DTYPES[layout.dtype]:
                raise LayoutMismatch(f"layer {name} KV dtype {head.dtype} differs from the configured {layout.dtype}")
            shape = self._io.block_shape(kv)
            if len(shape) != 3 or shape[1:] != (layout.kv_heads, layout.head_dim) or not shape[0] or block % shape[0]:
                raise LayoutMismatch(f"layer {name} (attention backend {backend_name}, paged layout {self._io.name}): "
                                     f"KV cache of shape {tuple(head.shape)} gives blocks of {shape}, not "
                                     f"[a divisor of block_size={block}, kv_heads={layout.kv_heads}, "
                                     f"head_dim={layout.head_dim}]")
            self._kernel_ratio = block // shape[0]
            self._layers[name] = i
        self._kv_caches = dict(kv_caches)
        logger.info("kvpool connector: %d layers, attention backend %s, paged layout %s, %d kernel block(s) per block, "
                    "chunk %d tokens, tp rank %d/%d", len(names), backend_name, self._io.name, self._kernel_ratio,
                    layout.chunk_tokens, self._tp_rank, self.settings.tp_size)

    def begin_step(self, meta: KVPoolConnectorMetadata) -> None:
        """Per-step state (once per bound metadata); chunk objects to save are allocated here and
        filled in place."""
        if meta is self._step_meta:
            return
        self._step_meta = meta
        self._active_loads, self._active_saves, self._loaded_layers = [], [], set()
        layout, chunk = self.settings.layout, self.settings.chunk_tokens
        for spec in getattr(meta, "saves", ()):
            store = self.store_for(spec.cache_salt)
            keys = store.chunk_keys(spec.token_ids)
            planned = [PlannedObject(keys[c], c * chunk, chunk, False, bytearray(layout.object_nbytes(chunk)))
                       for c in range(spec.first_chunk, len(keys))]
            payloads = [payload_tensor(obj.buffer, layout, chunk) for obj in planned]
            if planned:
                self._active_saves.append(_ActiveSave(spec, store, keys, planned, payloads))

    def start_load_kv(self, meta: KVPoolConnectorMetadata) -> None:
        """Fetch and verify the chunks of every LoadSpec; scatter later, layer by layer."""
        self.begin_step(meta)
        for spec in getattr(meta, "loads", ()):
            self._fetch(spec)
        if self.settings.load_mode == "sync":
            for name in self._layers:
                self.wait_for_layer_load(name)

    def _fetch(self, spec: LoadSpec) -> None:
        """The verified chunks of a LoadSpec, through the adapters' one reader: a missing or
        damaged chunk (removed from the pool, a "removed" event) ends the load there, and every
        block from it on is reported to vLLM, which recomputes them."""
        chunk, block = self.settings.chunk_tokens, self.settings.block_size
        if spec.start % block:
            raise InvalidArgument(f"load start {spec.start} of request {spec.req_id} is not block-aligned")
        store = self.store_for(spec.cache_salt)
        keys = store.chunk_keys(spec.token_ids)
        first = spec.start // chunk
        chunks: list[torch.Tensor | None] = [None] * first
        try:
            chunks += [view.as_torch() for view in store.reader.run(keys[first:])]
        except KVPoolError as exc:
            logger.warning("kvpool get failed for request %s: %s", spec.req_id, exc)
        end = max(spec.start, len(chunks) * chunk)
        if end < len(spec.token_ids):  # vLLM recomputes these blocks
            self._load_errors |= set(spec.block_ids[end // block: len(spec.token_ids) // block])
            self.stats["load_errors"] += 1
        self.stats["loaded_chunks"] += len(chunks) - first
        if end > spec.start:
            self._active_loads.append(_ActiveLoad(spec, chunks, end))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Scatter this layer of every fetched chunk into its paged blocks (once per step)."""
        if layer_name in self._loaded_layers or layer_name not in self._layers or not self._active_loads:
            return
        self._loaded_layers.add(layer_name)
        index, chunk, block = self._layers[layer_name], self.settings.chunk_tokens, self.settings.block_size
        kv_layer = self._kv_caches[layer_name]
        block_shape = self._io.block_shape(kv_layer)
        device = (kv_layer[0] if isinstance(kv_layer, (tuple, list)) else kv_layer).device
        for load in self._active_loads:
            for c in range(load.spec.start // chunk, -(-load.end // chunk)):
                t0, t1 = max(c * chunk, load.spec.start), min((c + 1) * chunk, load.end)
                src = load.chunks[c][index, :, :, t0 - c * chunk: t1 - c * chunk]  # [2, heads, T, dim]
                vals = src.permute(0, 2, 1, 3).reshape(2, -1, *block_shape).to(device)  # [2, kernel blocks, ...]
                ids = kernel_block_ids(load.spec.block_ids[t0 // block: t1 // block], self._kernel_ratio)
                self._io.write(kv_layer, torch.tensor(ids, dtype=torch.long, device=device), vals[0], vals[1])

    def save_kv_layer(self, meta: KVPoolConnectorMetadata, layer_name: str, kv_layer: Any) -> None:
        """Copy this layer of the chunks being saved out of the paged buffer, into their objects."""
        self.begin_step(meta)
        if not self._active_saves or layer_name not in self._layers:
            return
        index, chunk, block = self._layers[layer_name], self.settings.chunk_tokens, self.settings.block_size
        device = (kv_layer[0] if isinstance(kv_layer, (tuple, list)) else kv_layer).device
        for save in self._active_saves:
            for obj, payload in zip(save.planned, save.payloads):
                ids = kernel_block_ids(save.spec.block_ids[obj.start // block: (obj.start + chunk) // block], self._kernel_ratio)
                for kv_index, blocks in enumerate(self._io.read(kv_layer, torch.tensor(ids, dtype=torch.long, device=device))):
                    gathered = blocks.reshape(chunk, *blocks.shape[2:])  # [chunk, heads, dim]
                    payload[index, kv_index].copy_(gathered.permute(1, 0, 2))

    def wait_for_save(self) -> None:
        """Seal and write the chunks (inline, or in the background with async_save). Called as the
        forward pass ends, so it also reports loads whose layers were not all scattered (module
        invariants)."""
        if self._active_loads and len(self._loaded_layers) < len(self._layers):
            logger.error("wait_for_layer_load ran for %d of %d layers: reporting the loaded blocks as failed",
                         len(self._loaded_layers), len(self._layers))
            for load in self._active_loads:
                self._load_errors |= set(load.spec.block_ids[load.spec.start // self.settings.block_size:])
            self._active_loads = []
        if self._step_meta is None or not self._active_saves:
            return
        saves, self._active_saves = self._active_saves, []
        if not self.settings.async_save:
            self._write(saves)
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpool-save")
        future = self._executor.submit(self._write, saves)
        for save in saves:
            self._inflight.setdefault(save.spec.req_id, []).append(future)
            self._saving_reqs.add(save.spec.req_id)

    def _write(self, saves: list[_ActiveSave]) -> None:
        for save in saves:
            try:
                result = save.store.store(save.keys, save.planned, None, len(save.spec.token_ids))
                self.stats["saved_chunks"] += result.stored_chunks
            except KVPoolError as exc:  # a lost save is a future miss, never a failed request
                logger.warning("kvpool save of %d chunks for request %s failed: %s", len(save.planned), save.spec.req_id, exc)
                self.stats["save_errors"] += len(save.planned)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished saving, finished loading). Loads are synchronous, so the second is None."""
        self._finished_reqs |= set(finished_req_ids) & self._saving_reqs
        done = {r for r in self._finished_reqs if all(f.done() for f in self._inflight.get(r, []))}
        for req_id in done:
            self._finished_reqs.discard(req_id)
            self._saving_reqs.discard(req_id)
            self._inflight.pop(req_id, None)
        return (done or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def end_step(self) -> None:
        self._step_meta = None
        self._active_loads = []

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
