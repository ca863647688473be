"""The HuggingFace transformers adapter: `DynamicCache` <-> chunk objects in the pool.

For decoder-only models whose cache layers hold `keys`/`values` of shape
`[batch, kv_heads, seq, head_dim]` (Llama architecture and its relatives in transformers 5.x),
GQA included: the cache holds `num_key_value_heads` heads, which is what the layout stores.
float32, bfloat16 and float16 models; the layout dtype is the model's dtype, and a roundtrip is
bit-exact (bytes are copied, never converted).

Invariants beyond the contract (`engine_adapters.base`):
- Batch size 1: one adapter call is one sequence (`InvalidArgument` otherwise).
- A loaded cache holds positions 0..num_tokens of the prompt, bit for bit what was saved.
  Continuing the forward pass on it gives what one full pass computes up to float rounding of
  the split (float32 on this CPU: identical with one torch thread, up to ~6e-5 in the logits
  with two, where the reductions are split differently).
- `save` never modifies the cache it reads.
"""

from __future__ import annotations

import inspect
import logging
import threading
from typing import Any, Callable, Iterable, Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from engine_adapters.base import KVEvent, LoadResult, SaveResult
from engine_adapters.chunk_store import ChunkStore
from kvpool.chunk_format import ChunkView, KVLayout, payload_tensor
from kvpool.contract import PoolClient
from kvpool.errors import InvalidArgument
from kvpool.handle import KVHandle
from kvpool.keys import Namespace

log = logging.getLogger(__name__)

_TORCH_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def layout_for_model(model: Any, chunk_tokens: int, codec: str = "none") -> KVLayout:
    """The KV layout a transformers causal LM's cache has (dtype from its parameters), its chunks
    stored with `codec` (`kvpool.codec`)."""
    cfg = model.config.get_text_config(decoder=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype = _TORCH_DTYPES.get(model.dtype)
    if dtype is None:
        raise InvalidArgument(f"model dtype {model.dtype} has no KV layout (use float32, bfloat16 or float16)")
    return KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, dtype, chunk_tokens, codec)


def _cache_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(K, V) per layer of a DynamicCache (or a sequence of (K, V) pairs)."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    if isinstance(cache, (list, tuple)):
        return [(kv[0], kv[1]) for kv in cache]
    raise InvalidArgument(f"expected a DynamicCache or a sequence of (K, V), got {type(cache).__name__}")


def cache_from_layers(layers: Sequence[torch.Tensor], config: Any = None) -> DynamicCache:
    """A DynamicCache whose layer i holds views of `layers[i][0]` / `layers[i][1]` (`[2, H, T, D]`;
    `list(kv)` of a `[L, 2, H, T, D]` tensor), no copy."""
    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    for i, layer in enumerate(layers):
        k, v = layer[0].unsqueeze(0), layer[1].unsqueeze(0)
        if i < len(cache.layers):
            layer = cache.layers[i]
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v  # DynamicLayer.update would concatenate: a copy
        else:
            cache.update(k, v, i)
    return cache


class HFLayerwiseSave:
    """Copies each layer's K/V into the planned objects' payloads as the layer is handed over; `finish`
    seals and puts them once every layer was handed over. Planned at construction (one
    exists_batch), so only missing chunks are copied."""

    def __init__(self, adapter: "HFAdapter", token_ids: Sequence[int], request_id: str | None, start_token: int):
        self._adapter = adapter
        self.num_tokens = len(token_ids)
        self.keys, self.planned, self.tail = adapter.store.plan_save(token_ids, request_id=request_id,
                                                                     start_token=start_token)
        self._payloads = [payload_tensor(obj.buffer, adapter.layout, obj.tokens) for obj in self.planned]
        self._done = [False] * adapter.layout.num_layers
        self._finished = False

    def save_layer(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if not 0 <= i < len(self._done):
            raise InvalidArgument(f"layer {i} out of range 0..{len(self._done) - 1}")
        k, v = self._adapter.check_layer_kv(k, self.num_tokens), self._adapter.check_layer_kv(v, self.num_tokens)
        for obj, payload in zip(self.planned, self._payloads):
            payload[i, 0].copy_(k[:, obj.start:obj.start + obj.tokens, :])
            payload[i, 1].copy_(v[:, obj.start:obj.start + obj.tokens, :])
        self._done[i] = True

    def finish(self) -> SaveResult:
        if self._finished:
            raise InvalidArgument("this save has already finished")
        missing = [i for i, done in enumerate(self._done) if not done]
        if missing and self.planned:
            raise InvalidArgument(f"layers {missing[:5]}{'...' if len(missing) > 5 else ''} were never saved")
        self._finished = True
        return self._adapter.store.store(self.keys, self.planned, self.tail, self.num_tokens)

    def attach(self, cache: DynamicCache) -> DynamicCache:
        """Save each layer of `cache` the moment the forward pass appends it, so nothing is left to
        gather after the pass but sealing and the puts; call `finish()` then. On CPU the copy runs
        inline in the layer's `update`; it is the hook where a GPU engine starts its async
        device-to-host copy. The cache's layers must exist (built with the model config, loaded,
        or a `HFLayerwiseLoad.cache()`)."""
        if len(cache.layers) != self._adapter.layout.num_layers:
            raise InvalidArgument(f"cache has {len(cache.layers)} layers, the layout {self._adapter.layout.num_layers}")
        for i, layer in enumerate(cache.layers):
            layer.update = self._saving_update(i, layer.update)
        return cache

    def _saving_update(self, i: int, update):
        def saving_update(key_states, value_states, *args, **kwargs):
            keys, values = update(key_states, value_states, *args, **kwargs)
            if not self._done[i] and keys.shape[-2] >= self.num_tokens:
                self.save_layer(i, keys, values)
            return keys, values

        return saving_update


class _PendingLayer(DynamicLayer):
    """A cache layer whose KV is still arriving: it reports the loaded length at once, and the first
    `update` (the model reaching this layer) waits for the layer's KV before appending to it."""

    def __init__(self, load: "HFLayerwiseLoad", index: int, num_tokens: int):
        super().__init__()
        self._load: HFLayerwiseLoad | None = load
        self._index = index
        self._pending_tokens = num_tokens

    def _resolve(self) -> None:
        if self._load is not None:
            k, v = self._load.wait_layer(self._index)
            self.lazy_initialization(k, v)
            self.keys, self.values = k, v
            self._load = None

    def update(self, key_states, value_states, *args, **kwargs):
        self._resolve()
        return super().update(key_states, value_states, *args, **kwargs)

    def get_seq_length(self) -> int:
        return self._pending_tokens if self._load is not None else super().get_seq_length()


class HFLayerwiseLoad:
    """Fetches and verifies the cached prefix in a background thread, then joins its chunks layer
    by layer (`[2, H, T, D]` each); `wait_layer(i)` returns as soon as layer i is in place
    (on the model's device), and every waiter re-raises an error of the thread."""

    def __init__(self, adapter: "HFAdapter", token_ids: Sequence[int], max_tokens: int | None):
        self._adapter = adapter
        self._layers: list[torch.Tensor] = []  # layer i on the model's device, once ready
        self._fetched = threading.Event()
        self._ready = [threading.Event() for _ in range(adapter.layout.num_layers)]
        self._error: BaseException | None = None
        self._num_tokens = 0
        self._thread = threading.Thread(target=self._run, args=(list(token_ids), max_tokens), daemon=True,
                                        name="kvpool-hf-load")
        self._thread.start()

    def _run(self, ids: list[int], max_tokens: int | None) -> None:
        try:
            views = self._adapter.store.fetch_prefix(ids, max_tokens)
            self._num_tokens = sum(v.tokens for v in views)
            sources = [v.as_torch() for v in views]  # the fetched chunks, [L, 2, H, tokens, D] each
            self._fetched.set()
            device = self._adapter.device
            for i, ready in enumerate(self._ready):
                if sources:
                    layer = torch.cat([src[i] for src in sources], dim=2)  # on the host, where the bytes are
                    self._layers.append(layer if device.type == "cpu" else layer.to(device))
                ready.set()
        except BaseException as exc:  # handed to the waiting thread, which re-raises it
            self._error = exc
            self._fetched.set()
            for ready in self._ready:
                ready.set()

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def num_tokens(self) -> int:
        """Tokens being loaded; blocks until the chunks are fetched and verified."""
        self._fetched.wait()
        self._check()
        return self._num_tokens

    def wait_layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self._ready):
            raise InvalidArgument(f"layer {i} out of range 0..{len(self._ready) - 1}")
        self._ready[i].wait()
        self._check()
        if not self._num_tokens:
            raise InvalidArgument("nothing was loaded (num_tokens() == 0): there is no layer KV to wait for")
        layer = self._layers[i]
        return layer[0].unsqueeze(0), layer[1].unsqueeze(0)

    def wait(self) -> LoadResult:
        self._thread.join()
        self._check()
        if not self._num_tokens:
            return LoadResult(0, None)
        return LoadResult(self._num_tokens, cache_from_layers(self._layers, self._adapter.model.config))

    def cache(self) -> DynamicCache:
        """A DynamicCache of the loaded prefix to run the model on right away: the model's first use
        of layer i (its `update`) waits for that layer only, so the scatter of later layers overlaps
        the compute of earlier ones. Blocks until the chunks are fetched and verified."""
        n = self.num_tokens()
        cache = DynamicCache(config=self._adapter.model.config)
        if n:
            cache.layers = [_PendingLayer(self, i, n) for i in range(len(self._ready))]
        return cache


class HFAdapter:
    """The adapter contract (`engine_adapters.base.EngineAdapter`) for a transformers causal LM.

    `namespace.layout` must equal the model's own layout with the namespace's chunk size and codec
    (`layout_for_model`); a mismatch raises `InvalidArgument` at construction, because KV saved
    under a wrong layout could be loaded by the wrong model.
    """

    def __init__(self, pool: PoolClient, model: Any, namespace: Namespace, *, mac_key: bytes | None = None):
        self.model = model
        layout = layout_for_model(model, namespace.chunk_tokens, namespace.layout.codec)
        if layout != namespace.layout:
            raise InvalidArgument(f"namespace layout {namespace.layout} does not match the model's KV layout {layout}")
        self.namespace = namespace
        self.layout = layout
        self.torch_dtype = model.dtype
        self.device = model.device  # loaded KV goes here; saved KV is copied to the host first
        self.store = ChunkStore(pool, namespace, mac_key=mac_key)  # mac_key: chunks MACed per tenant

    # -- engine format ---------------------------------------------------------------------

    def check_layer_kv(self, t: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """One layer's K or V as `[kv_heads, >= num_tokens, head_dim]` (batch dim of 1 dropped)."""
        if not isinstance(t, torch.Tensor):
            raise InvalidArgument(f"layer KV must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() == 4:
            if t.shape[0] != 1:
                raise InvalidArgument(f"the HF adapter saves one sequence at a time; got batch {t.shape[0]}")
            t = t[0]
        lay = self.layout
        if t.dim() != 3 or t.shape[0] != lay.kv_heads or t.shape[2] != lay.head_dim:
            raise InvalidArgument(f"layer KV has shape {tuple(t.shape)}, expected [1, {lay.kv_heads}, T, {lay.head_dim}]")
        if t.shape[1] < num_tokens:
            raise InvalidArgument(f"the cache holds {t.shape[1]} tokens, fewer than the {num_tokens} token ids")
        if t.dtype != self.torch_dtype:
            raise InvalidArgument(f"layer KV is {t.dtype}, the layout stores {self.torch_dtype}")
        return t.detach().to("cpu") if t.device.type != "cpu" else t.detach()

    def _cache_from_views(self, views: list[ChunkView]) -> DynamicCache:
        kv = torch.cat([view.as_torch() for view in views], dim=3)  # [L, 2, H, tokens, D]
        if self.device.type != "cpu":  # assembled on the host, where the bytes arrive; one copy over
            kv = kv.to(self.device)
        return cache_from_layers(list(kv), self.model.config)  # views of kv, no copy

    # -- the contract ------------------------------------------------------------------------

    def chunk_keys(self, token_ids: Sequence[int]) -> list[str]:
        return self.store.chunk_keys(token_ids)

    def lookup(self, token_ids: Sequence[int], max_tokens: int | None = None) -> int:
        return self.store.lookup(token_ids, max_tokens)

    def make_handle(self, token_ids: Sequence[int], saved: SaveResult) -> KVHandle:
        return self.store.make_handle(token_ids, saved)

    def release_handle(self, handle: KVHandle) -> None:
        self.store.release_handle(handle)

    def remove(self, keys: Sequence[str]) -> list[bool]:
        return self.store.remove(keys)

    def add_listener(self, callback: Callable[[KVEvent], None]) -> None:
        self.store.add_listener(callback)

    def remove_listener(self, callback: Callable[[KVEvent], None]) -> None:
        self.store.remove_listener(callback)

    def load(self, token_ids: Sequence[int], max_tokens: int | None = None) -> LoadResult:
        views = self.store.fetch_prefix(token_ids, max_tokens)
        if not views:
            return LoadResult(0, None)
        return LoadResult(sum(v.tokens for v in views), self._cache_from_views(views))

    def start_load(self, token_ids: Sequence[int], max_tokens: int | None = None) -> HFLayerwiseLoad:
        return HFLayerwiseLoad(self, token_ids, max_tokens)

    def start_save(self, token_ids: Sequence[int], *, request_id: str | None = None,
                   start_token: int = 0) -> HFLayerwiseSave:
        return HFLayerwiseSave(self, token_ids, request_id, start_token)

    def save(self, token_ids: Sequence[int], cache: Any, *, request_id: str | None = None,
             start_token: int = 0) -> SaveResult:
        layers = _cache_layers(cache)
        if len(layers) != self.layout.num_layers:
            raise InvalidArgument(f"cache has {len(layers)} layers, the layout {self.layout.num_layers}")
        saver = self.start_save(token_ids, request_id=request_id, start_token=start_token)
        for i, (k, v) in enumerate(layers):
            if k is None or v is None:
                raise InvalidArgument(f"cache layer {i} is empty")
            saver.save_layer(i, k, v)
        return saver.finish()

    def load_handle(self, handle: KVHandle) -> DynamicCache:
        views = self.store.fetch_handle(handle)
        if not views:
            raise InvalidArgument("KV handle names no objects (0 tokens)")
        return self._cache_from_views(views)


# -- running the model on a cache (used by the reference workers and the tests) ------------------

@torch.inference_mode()
def forward(model: Any, token_ids: Sequence[int],
            cache: DynamicCache | None = None) -> tuple[torch.Tensor, DynamicCache]:
    """Run the tokens that `cache` does not yet hold; return (last-position logits [vocab], cache).

    `token_ids` is the whole sequence so far; the cache holds its first `cache.get_seq_length()`
    tokens (or nothing). The cache is extended in place (a new one when None).
    """
    cache = cache if cache is not None else DynamicCache(config=model.config)
    have = cache.get_seq_length()
    if have >= len(token_ids):
        raise InvalidArgument(f"the cache already holds {have} of {len(token_ids)} tokens: nothing to compute")
    new = torch.tensor([list(token_ids[have:])], dtype=torch.long, device=model.device)
    out = model(input_ids=new, use_cache=True, **{cache_argument(model): cache})
    return out.logits[0, -1], out.cache if getattr(out, "cache", None) is not None else cache


def cache_argument(model: Any) -> str:
    """The name of the model's cache argument: `cache` in current transformers, `past_key_values`
    before (vLLM 0.32, in .venv-vllm, pins transformers < 5.20, which still uses that name)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.inference_mode()
def greedy_continue(model: Any, token_ids: Sequence[int], cache: DynamicCache | None, max_new_tokens: int,
                    eos_token_ids: Iterable[int] = ()) -> list[int]:
    """Greedy tokens after `token_ids`, computing only what `cache` lacks; stops after an EOS token."""
    eos = set(eos_token_ids)
    ids = list(token_ids)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits, cache = forward(model, ids, cache)
        token = int(torch.argmax(logits))
        out.append(token)
        ids.append(token)
        if token in eos:
            break
    return out


__all__ = ["HFAdapter", "HFLayerwiseLoad", "HFLayerwiseSave", "KVEvent", "KVHandle", "LoadResult", "SaveResult",
           "cache_from_layers", "forward", "greedy_continue", "layout_for_model"]
