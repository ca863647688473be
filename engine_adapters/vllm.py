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
- Values are kvpool chunk objects (`kvpool.layout`, layer-major payload), so a vLLM worker and the
  HuggingFace reference workers read each other's chunks when their namespaces agree.
- Scheduler side: `get_num_new_matched_tokens` asks the pool for the longest cached chunk prefix
  (one `match_prefix` per TP rank), always leaving at least one prompt token to compute; it
  loads synchronously (returns `False` for "async"). `build_connector_meta` turns the step into
  `LoadSpec`s (blocks to fill) and `SaveSpec`s (full chunks that become computed in this step).
- Worker side: `start_load_kv` fetches and verifies the chunk objects; `wait_for_layer_load`
  scatters one layer into the paged blocks (the payload is layer-major, so layer i needs only
  its own slice); `save_kv_layer` copies one layer of the chunks being saved straight into the
  payloads of their chunk objects; `wait_for_save` seals them and writes them with one
  `put_batch` (through `engine_adapters.base.ChunkStore`, which also emits "stored" events).

Invariants:
- A chunk that is missing, fails its checksum or has another layout is a miss: nothing of it or
  of later chunks is written to the paged cache, and every block of the request's load range
  from that chunk on is reported by `get_block_ids_with_load_errors` (vLLM then recomputes them
  with `"kv_load_failure_policy": "recompute"`; its default, "fail", fails the request).
  A damaged chunk is also removed from the pool (a "removed" event) so a later save replaces it.
- Saves copy the KV out of the paged buffer before `wait_for_save` returns, so vLLM may reuse the
  blocks afterwards. With `async_save`, the pool writes finish in the background;
  `request_finished` then returns True for requests that had saves, and `get_finished` reports
  each such id (and only those) once it was finished by the scheduler and all its writes ended.
- A pool error never fails a request: lookups count as misses, failed saves are logged.
"""

from __future__ import annotations

import inspect
import logging
import re
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from engine_adapters.base import ChunkStore, PlannedObject
from engine_adapters.vllm_layout import TORCH_DTYPES, ConnectorSettings, attention_layers, layer_backend
from engine_adapters.vllm_pages import PageMapIO, ViewIO, kernel_block_ids, resolve_block_io
from kvpool.api import PoolClient
from kvpool.errors import CorruptObject, FormatError, InvalidArgument, KVPoolError, LayoutMismatch
from kvpool.keys import chunk_keys_hex
from kvpool.layout import HEADER_SIZE, decode_chunk

try:  # the real base class where vLLM is installed
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )

    VLLM_AVAILABLE = True
except ImportError:  # CPU-only machines: a stand-in that is named and documented as fake
    from engine_adapters._fakes.vllm_api import FakeKVConnectorMetadata as KVConnectorMetadata
    from engine_adapters._fakes.vllm_api import FakeKVConnectorRole as KVConnectorRole
    from engine_adapters._fakes.vllm_api import _FakeKVConnectorBase_V1 as KVConnectorBase_V1

    VLLM_AVAILABLE = False

logger = logging.getLogger(__name__)

METADATA_VERSION = 1


# ---- scheduler -> worker metadata (vLLM pickles it to the workers once per step) ----


@dataclass
class LoadSpec:
    """Fill the paged blocks of tokens [start, len(token_ids)) from the pool's chunks.

    `token_ids` is the cached prefix (a whole number of chunks); `block_ids` cover it; `start` is
    block-aligned (tokens before it are already in vLLM's local prefix cache).
    """

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    start: int


@dataclass
class SaveSpec:
    """Save chunks [first_chunk, len(token_ids) // chunk_tokens) once this step has computed them."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    first_chunk: int


@dataclass
class KVPoolConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    version: int = METADATA_VERSION


@dataclass
class _Track:
    """Scheduler-side state of one request between allocation and finish."""

    token_ids: list[int]
    hit_chunks: int  # chunks present in the pool when the request was looked up: never re-saved
    saved_chunks: int  # chunks handed to the workers for saving so far (or present)
    load: tuple[int, int] | None = None  # token range to load in the next step
    block_ids: list[int] = field(default_factory=list)


@dataclass
class _ActiveLoad:
    spec: LoadSpec
    chunks: list[torch.Tensor | None]  # by chunk index; verified payloads [layers, 2, heads, chunk, dim]
    end: int  # tokens [spec.start, end) are loadable


@dataclass
class _ActiveSave:
    spec: SaveSpec
    keys: list[str]  # every full-chunk key of spec.token_ids
    planned: list[PlannedObject]  # chunk objects being filled in place, layer by layer
    payloads: list[torch.Tensor]  # per planned object, its payload as [layers, 2, heads, chunk, dim]


class KVPoolConnector(KVConnectorBase_V1):
    """vLLM KV connector (v1 API) backed by the kvpool. One instance per role and process."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None, *, client: PoolClient | None = None):
        if "kv_cache_config" in inspect.signature(KVConnectorBase_V1.__init__).parameters:
            super().__init__(vllm_config, role, kv_cache_config)
        else:  # vLLM before 0.11 constructs connectors with (vllm_config, role)
            super().__init__(vllm_config, role)
        self.settings = ConnectorSettings.from_vllm_config(vllm_config)
        if self.settings.loads and getattr(self._kv_transfer_config, "kv_load_failure_policy", None) == "fail":
            logger.warning("kv_load_failure_policy is 'fail' (vLLM's default): a chunk evicted or damaged between lookup "
                           "and load fails its request instead of being recomputed; set \"kv_load_failure_policy\": "
                           "\"recompute\" in --kv-transfer-config")
        self._client = client
        self._owns_client = client is None
        self._store: ChunkStore | None = None
        # scheduler side
        self._namespaces = [self.settings.namespace(r).digest() for r in range(self.settings.tp_size)]
        self._lookups: dict[str, int] = {}  # req id -> chunks found by the last lookup
        self._tracks: dict[str, _Track] = {}
        self._reqs_with_saves: set[str] = set()  # survives preemption: decides request_finished's delay
        # worker side
        self._tp_rank = self._resolve_tp_rank()
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
        self.stats = {"lookups": 0, "hit_chunks": 0, "loaded_chunks": 0, "load_errors": 0, "saved_chunks": 0, "save_errors": 0}

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True: loads and saves run in the per-layer hooks, which full CUDA graphs would skip."""
        return True

    @property
    def paged_layout(self) -> str | None:
        """How this worker moves blocks: a view layout's name, or "probed" (None before registration)."""
        return None if self._io is None else self._io.name

    @property
    def client(self) -> PoolClient:
        if self._client is None:
            import kvpool

            self._client = kvpool.connect(self.settings.address)
        return self._client

    @property
    def store(self) -> ChunkStore:
        """The adapters' engine-free half (engine_adapters.base): keys, verification, events."""
        if self._store is None:
            self._store = ChunkStore(self.client, self.settings.namespace(self._tp_rank))
        return self._store

    def add_listener(self, callback: Any) -> None:
        """KVEvent callbacks ("stored" / "removed" chunk keys) for the router's prefix index."""
        self.store.add_listener(callback)

    def _resolve_tp_rank(self) -> int:
        extra = getattr(self._kv_transfer_config, "kv_connector_extra_config", None) or {}
        if "tp_rank" in extra:
            return int(extra["tp_rank"])
        if VLLM_AVAILABLE and self.settings.tp_size > 1 and self.role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            return int(get_tensor_model_parallel_rank())
        return 0

    # ==================== scheduler side ====================

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond `num_computed_tokens` that the pool holds; loads are synchronous."""
        tokens = list(request.prompt_token_ids or [])
        chunk = self.settings.chunk_tokens
        usable = max(0, (len(tokens) - 1) // chunk)  # vLLM must compute at least one token
        found = 0
        if usable:
            self.stats["lookups"] += 1
            try:  # every TP rank holds its own shard: the usable prefix is the shortest
                found = min(self.client.match_prefix(chunk_keys_hex(ns, tokens[: usable * chunk], chunk))
                            for ns in self._namespaces)
            except KVPoolError as exc:
                logger.warning("kvpool lookup failed for request %s, treating as a miss: %s", request.request_id, exc)
        self._lookups[request.request_id] = found
        if not self.settings.loads:
            return 0, False
        return max(0, found * chunk - num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        found = self._lookups.pop(request.request_id, 0)
        track = _Track(token_ids=list(request.prompt_token_ids or []), hit_chunks=found, saved_chunks=found)
        if num_external_tokens > 0:
            end = found * self.settings.chunk_tokens
            track.load = (end - num_external_tokens, end)
            self.stats["hit_chunks"] += found
        self._tracks[request.request_id] = track

    def build_connector_meta(self, scheduler_output: Any) -> KVPoolConnectorMetadata:
        meta = KVPoolConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            track = self._tracks.get(new.req_id)
            if track is not None:
                track.block_ids = list(new.block_ids[0])
                self._plan(meta, new.req_id, track, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None)  # older vLLM: a resumed_from_preemption list
        for i, req_id in enumerate(cached.req_ids):
            track = self._tracks.get(req_id)
            if track is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if new_blocks is not None:
                was_resumed = req_id in resumed if resumed is not None else bool(cached.resumed_from_preemption[i])
                track.block_ids = list(new_blocks[0]) if was_resumed else track.block_ids + list(new_blocks[0])
            self._plan(meta, req_id, track, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _plan(self, meta: KVPoolConnectorMetadata, req_id: str, track: _Track, computed_after_step: int) -> None:
        chunk, block = self.settings.chunk_tokens, self.settings.block_size
        if track.load is not None:
            start, end = track.load
            meta.loads.append(LoadSpec(req_id, track.token_ids[:end], track.block_ids[: end // block], start))
            track.load = None
        full = min(computed_after_step, len(track.token_ids)) // chunk
        if self.settings.saves and full > track.saved_chunks:
            n = full * chunk
            meta.saves.append(SaveSpec(req_id, track.token_ids[:n], track.block_ids[: n // block], track.saved_chunks))
            track.saved_chunks = full
            self._reqs_with_saves.add(req_id)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Delay freeing the blocks only for async saves of this request (see module invariants)."""
        self._lookups.pop(request.request_id, None)
        track = self._tracks.pop(request.request_id, None)
        had_saves = request.request_id in self._reqs_with_saves
        self._reqs_with_saves.discard(request.request_id)
        if track is None:
            return False, None
        # The workers report exactly the requests they got a SaveSpec for: the same set as here.
        delay = self.settings.async_save and had_saves
        params = None
        if self.settings.kv_role == "kv_producer":
            params = {"kvpool_cached_tokens": track.saved_chunks * self.settings.chunk_tokens,
                      "kvpool_chunk_tokens": self.settings.chunk_tokens}
        return delay, params

    # ==================== worker side ====================

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

    def _begin_step(self) -> KVPoolConnectorMetadata:
        """Per-step worker state; chunk objects to save are allocated here and filled in place."""
        meta = self._get_connector_metadata()
        if meta is self._step_meta:
            return meta
        self._step_meta = meta
        self._active_loads, self._active_saves, self._loaded_layers = [], [], set()
        layout, chunk = self.settings.layout, self.settings.chunk_tokens
        count = layout.payload_nbytes(chunk) // layout.itemsize
        for spec in getattr(meta, "saves", ()):
            keys = self.store.chunk_keys(spec.token_ids)
            planned = [PlannedObject(keys[c], c * chunk, chunk, False, bytearray(layout.object_nbytes(chunk)))
                       for c in range(spec.first_chunk, len(keys))]
            payloads = [torch.frombuffer(obj.buffer, dtype=TORCH_DTYPES[layout.dtype], count=count, offset=HEADER_SIZE)
                        .view(layout.shape(chunk)) for obj in planned]
            if planned:
                self._active_saves.append(_ActiveSave(spec, keys, planned, payloads))
        return meta

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Fetch and verify the chunks of every LoadSpec; scatter later, layer by layer."""
        meta = self._begin_step()
        for spec in getattr(meta, "loads", ()):
            self._fetch(spec)
        if self.settings.load_mode == "sync":
            for name in self._layers:
                self.wait_for_layer_load(name)

    def _fetch(self, spec: LoadSpec) -> None:
        layout, chunk, block = self.settings.layout, self.settings.chunk_tokens, self.settings.block_size
        if spec.start % block:
            raise InvalidArgument(f"load start {spec.start} of request {spec.req_id} is not block-aligned")
        keys = self.store.chunk_keys(spec.token_ids)
        first = spec.start // chunk
        chunks: list[torch.Tensor | None] = [None] * first
        try:
            blobs = self.client.get_batch(keys[first:])
        except KVPoolError as exc:
            logger.warning("kvpool get failed for request %s: %s", spec.req_id, exc)
            blobs = []
        for key, blob in zip(keys[first:], blobs):
            if blob is None:  # evicted since the lookup: the prefix ends here
                break
            try:
                view = decode_chunk(blob, layout)
                if view.tokens != chunk:
                    raise FormatError(f"chunk holds {view.tokens} tokens, expected {chunk}")
            except (CorruptObject, LayoutMismatch) as exc:
                logger.warning("request %s: chunk %s unusable (%s), treated as a miss", spec.req_id, key, exc)
                self._drop_damaged(key)
                break
            chunks.append(view.as_torch())
        end = max(spec.start, len(chunks) * chunk)
        if end < len(spec.token_ids):  # vLLM recomputes these blocks
            self._load_errors |= set(spec.block_ids[end // block: len(spec.token_ids) // block])
            self.stats["load_errors"] += 1
        self.stats["loaded_chunks"] += len(chunks) - first
        if end > spec.start:
            self._active_loads.append(_ActiveLoad(spec, chunks, end))

    def _drop_damaged(self, key: str) -> None:
        """Remove a damaged chunk (a "removed" event) so a later save can store a good copy."""
        try:
            self.store.remove([key])
        except KVPoolError as exc:
            logger.warning("could not remove damaged chunk %s: %s", key, exc)

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

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Copy this layer of the chunks being saved out of the paged buffer, into their objects."""
        self._begin_step()
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
        """Seal and write the chunks (inline, or in the background with async_save).

        Called as the forward pass ends: a loaded request whose layers were not all scattered
        before their attention ran (hooks skipped) computed on missing KV, so its loaded blocks
        are reported as load errors and vLLM recomputes them.
        """
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
                result = self.store.store(save.keys, save.planned, None, len(save.spec.token_ids))
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

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._step_meta = None
        self._active_loads = []

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._owns_client and self._client is not None:
            self._client.close()
            self._client = None
