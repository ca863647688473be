"""SGLang HiCache storage backend (the "L3" tier of HiCache) backed by the kvpool.

Enable it in SGLang (see docs/sglang.md) as a dynamic backend:

    python -m sglang.launch_server --model-path MODEL --page-size 64 --enable-hierarchical-cache \\
        --hicache-mem-layout page_first --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvpool",
            "module_path": "engine_adapters.sglang", "class_name": "KVPoolHiCacheStorage",
            "interface_v1": 1, "kvpool_address": "127.0.0.1:7600"}'

Semantics:
- One SGLang page (`page_size` tokens, all layers, K and V) is one kvpool chunk object
  (`kvpool.chunk_format`, layer-major payload, checksummed) of a `KVLayout` whose `chunk_tokens`
  is the page size. The page's bytes are converted from the host pool's layout (layer_first,
  page_first, page_first_direct) to the chunk layout on write and back on read.
- SGLang computes its own page keys (a hash chain over page tokens). The pool key is
  `sglang/<namespace hex>/<sglang key>`, where the namespace (kvpool.keys.Namespace) covers the
  model, weights fingerprint, KV layout, page size and TP rank: two models, layouts or TP ranks
  never share a page.
- Both of SGLang's IO paths exist: the generic one (`get`/`set`/`batch_get`/`batch_set` on flat
  page tensors) and the zero-copy page path (`batch_get_v1`/`batch_set_v1` on host-pool indices,
  chosen by SGLang when the extra config has `"interface_v1": 1`), which reads and writes the
  host pool's buffer in place without an intermediate flat page.
- These methods run on SGLang's prefetch/backup threads, which are never restarted: they never
  raise. A missing, damaged (checksum), unauthenticated or foreign-layout page is a miss (None /
  False), and a pool error is logged and reported the same way. Pages are read through the
  adapters' one reader (`engine_adapters.chunk_reader`), whose rule decides whether a failed page
  is removed (so the next backup stores a good copy) or left: each page names its namespace and
  pool key, and with a keyring (`KVPOOL_AUTH_FILE`) carries a MAC under the chunk MAC key of the
  principal the pool client authenticates as (`KVPOOL_PRINCIPAL`, a tenant). Configuration errors
  raise at construction or `register_mem_pool_host`, with a typed `kvpool.errors` error.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, List, Optional

import torch

from engine_adapters.chunk_reader import ChunkReader
from engine_adapters.compat import require
from engine_adapters.chunk_store import plugin_mac_key, plugin_tenant_salt
from kvpool.chunk_format import ChunkAuth, ChunkView, KVLayout, encode_chunk, payload_tensor, seal_into
from kvpool.codec import get_codec
from kvpool.config import current_settings
from kvpool.contract import PoolClient
from kvpool.errors import InvalidArgument, KVPoolError
from kvpool.keys import Namespace

try:  # the real base class where SGLang is installed
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    SGLANG_AVAILABLE = True
except ImportError:  # SGLang not installed: the backend still imports (it defines every method it serves)
    HiCacheStorage = object

    SGLANG_AVAILABLE = False

try:  # the v2 interface's types (SGLang 0.5.23 on)
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransferResult

    KV_POOL: Any = PoolName.KV  # SGLang's name of the KV pool
except ImportError:
    KV_POOL = "kv"

    @dataclass
    class PoolTransferResult:  # SGLang's (same fields), where SGLang has none
        kv_hit_pages: int
        extra_pool_hit_pages: dict
        restorable_prefix_pages: Optional[List[int]] = None

logger = logging.getLogger(__name__)

_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
# host layout -> how one page looks as a 5-d view, as a permutation to the chunk's
# [layers, 2, heads, tokens, head_dim] order ("2LPHD": dims are kv, layer, page token, head, dim)
_PAGE_TO_CHUNK = {
    "layer_first": (1, 0, 3, 2, 4),  # page view [2, L, P, H, D]
    "page_first": (2, 0, 3, 1, 4),  # page view [2, P, L, H, D]
    "page_first_direct": (1, 0, 3, 2, 4),  # page view [2, 1, L, P, H, D] squeezed to [2, L, P, H, D]
}


class KVPoolHiCacheStorage(HiCacheStorage):
    """HiCacheStorage whose pages live in the kvpool as chunk objects (see module docstring).

    SGLang constructs dynamic backends as `cls(storage_config, kwargs)` and then calls
    `register_mem_pool_host(host_pool)`; no page IO happens before that registration.
    """

    def __init__(self, storage_config: Any, kwargs: Optional[dict] = None, *, client: PoolClient | None = None):
        require("sglang")
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        if getattr(storage_config, "is_mla_model", False):
            raise InvalidArgument("KVPoolHiCacheStorage stores K and V pages; MLA (latent) KV caches are not supported")
        self.tp_rank = int(getattr(storage_config, "tp_rank", 0))
        self.tp_size = int(getattr(storage_config, "tp_size", 1))
        self.pp_rank = int(getattr(storage_config, "pp_rank", 0))
        self.model_id = str(extra.get("model_id") or getattr(storage_config, "model_name", None) or "unknown-model")
        settings = current_settings()  # what the engine's own extra_config leaves out
        self.weights_fingerprint = str(extra.get("weights_fingerprint", settings.connector.weights_fingerprint))
        # pipeline stages hold different layers: the salt keeps their pages apart
        salt = plugin_tenant_salt(extra)
        self.tenant_salt = salt if self.pp_rank == 0 else f"{salt}/pp{self.pp_rank}"
        self.address = str(extra.get("kvpool_address", settings.pool.master))
        # how pages are stored (kvpool.codec; part of the layout and so of the namespace): lossless
        # unless the extra config names a codec; the v2 side pools are always stored lossless
        self.kv_codec = str(extra.get("kv_codec", settings.pool.kv_codec))
        self._codec = get_codec(self.kv_codec)  # an unknown name is InvalidArgument now
        self._client = client
        self._owns_client = client is None
        self._reader: ChunkReader | None = None
        self.mem_pool_host: Any = None
        self.layout: KVLayout | None = None
        self._prefix = ""
        self.stats = {"get_hits": 0, "get_misses": 0, "corrupt": 0, "set_ok": 0, "set_failed": 0}
        host = (kwargs or {}).get("mem_pool_host") if isinstance(kwargs, dict) else None
        if host is not None:
            self.register_mem_pool_host(host)

    @property
    def client(self) -> PoolClient:
        if self._client is None:
            import kvpool

            self._client = kvpool.connect(self.address)
        return self._client

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Learn the page geometry from SGLang's host KV pool and derive the key namespace."""
        host_layout = getattr(mem_pool_host, "layout", "layer_first")
        if host_layout not in _PAGE_TO_CHUNK:
            raise InvalidArgument(f"host pool layout {host_layout!r} is not supported (use {sorted(_PAGE_TO_CHUNK)})")
        dtype = _DTYPES.get(mem_pool_host.dtype)
        if dtype is None:
            raise InvalidArgument(f"host pool dtype {mem_pool_host.dtype} is not supported (float16, bfloat16, float32)")
        for name in ("layer_num", "head_num", "head_dim", "page_size"):
            if not hasattr(mem_pool_host, name):
                raise InvalidArgument(f"host pool has no {name!r}: only MHA host pools are supported")
        self.layout = KVLayout(int(mem_pool_host.layer_num), int(mem_pool_host.head_num), int(mem_pool_host.head_dim),
                               dtype, int(mem_pool_host.page_size), self.kv_codec)
        self.mem_pool_host = mem_pool_host
        self.host_layout = host_layout
        self._perm = _PAGE_TO_CHUNK[host_layout]
        self._unperm = tuple(self._perm.index(i) for i in range(len(self._perm)))  # chunk -> page
        ns = Namespace(self.model_id, self.weights_fingerprint, self.layout, self.tp_rank, self.tp_size, self.tenant_salt)
        self._prefix = f"sglang/{ns.hex()}/"
        self._auth = ChunkAuth(ns.digest(), plugin_mac_key())
        logger.info("kvpool HiCache backend: %s layout, page %d tokens, %d B per page, namespace %s",
                    host_layout, self.layout.chunk_tokens, self.layout.object_nbytes(), ns.hex())

    # ---- helpers ----

    def pool_key(self, key: str) -> str:
        if self.layout is None:
            raise InvalidArgument("register_mem_pool_host must be called before page IO")
        return self._prefix + key

    def _page_shape(self) -> tuple[int, ...]:
        lay = self.layout
        if self.host_layout == "page_first":
            return (2, lay.chunk_tokens, lay.num_layers, lay.kv_heads, lay.head_dim)
        return (2, lay.num_layers, lay.chunk_tokens, lay.kv_heads, lay.head_dim)

    def _host_page(self, index: int) -> torch.Tensor:
        """A 5-d view of the host buffer's page starting at token slot `index` (no copy)."""
        buf, page = self.mem_pool_host.kv_buffer, self.layout.chunk_tokens
        if index % page:
            raise InvalidArgument(f"host index {index} is not page-aligned (page size {page})")
        if self.host_layout == "layer_first":
            return buf[:, :, index:index + page]
        if self.host_layout == "page_first":
            return buf[:, index:index + page]
        return buf[:, index // page]

    def _encode(self, page: torch.Tensor, key: str) -> bytearray:
        """Page (5-d view in the host layout) -> chunk object bound to the pool key of `key`."""
        lay, pool_key = self.layout, self.pool_key(key)
        chunk = page.permute(self._perm)  # layer-major view of the page
        if lay.codec != "none":  # encoded on save; the reader decodes on load
            return encode_chunk(lay, chunk, key=pool_key, auth=self._auth, codec=self._codec)
        out = bytearray(lay.object_nbytes())
        payload_tensor(out, lay, lay.chunk_tokens).copy_(chunk)  # the one copy, into layer-major order
        seal_into(out, lay, lay.chunk_tokens, key=pool_key, auth=self._auth)
        return out

    def _read_pages(self, keys: List[str]) -> list[ChunkView | None]:
        """Verified pages (None: missing, or damaged and removed), one batched read."""
        pool_keys = [self.pool_key(k) for k in keys]  # refuses page IO before register_mem_pool_host
        if self._reader is None or self._reader.layout != self.layout:
            self._reader = ChunkReader(self.client, self.layout, auth=self._auth)
        damaged = self._reader.damaged
        views = self._reader.read(pool_keys)
        self.stats["corrupt"] += self._reader.damaged - damaged
        return views

    def _copy_page(self, view: ChunkView | None, page: torch.Tensor) -> bool:
        """Copy a verified page into `page` (a 5-d view in the host layout); False for a miss."""
        if view is None:
            self.stats["get_misses"] += 1
            return False
        page.copy_(view.as_torch().permute(self._unperm))
        self.stats["get_hits"] += 1
        return True

    def _flat_as_page(self, flat: Any) -> torch.Tensor | None:
        shape = self._page_shape()
        if not isinstance(flat, torch.Tensor) or flat.numel() != self.layout.chunk_tokens * self.layout.bytes_per_token // self.layout.itemsize:
            logger.error("page tensor has %s elements, expected shape %s", getattr(flat, "numel", lambda: "?")(), shape)
            return None
        if flat.dtype != self.mem_pool_host.dtype:
            logger.error("page tensor dtype %s differs from the host pool's %s", flat.dtype, self.mem_pool_host.dtype)
            return None
        return flat.reshape(shape)

    def _pages_at(self, keys: List[str], host_indices: Any) -> list[int]:
        page = self.layout.chunk_tokens
        if host_indices is None or host_indices.numel() < len(keys) * page:
            raise InvalidArgument(f"{len(keys)} pages need {len(keys) * page} host indices")
        starts = [int(host_indices[i * page]) for i in range(len(keys))]
        limit = getattr(self.mem_pool_host, "size", None)
        if any(s % page or (limit is not None and s + page > limit) for s in starts):
            raise InvalidArgument(f"host pages must start at multiples of {page} inside the pool: {starts}")
        return starts

    # ---- generic interface (flat page tensors) ----

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """The page under `key` as a flat tensor (written into `target_location` if given), or None."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: List[str], target_locations: Any = None, target_sizes: Any = None) -> List[torch.Tensor | None]:
        try:
            views = self._read_pages(keys)
        except KVPoolError as exc:
            logger.warning("kvpool batch_get of %d pages failed: %s", len(keys), exc)
            return [None] * len(keys)
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        out: List[torch.Tensor | None] = []
        for view, target in zip(views, targets):
            if target is None:
                target = self.mem_pool_host.get_dummy_flat_data_page() if hasattr(self.mem_pool_host, "get_dummy_flat_data_page") \
                    else torch.empty(self.layout.chunk_tokens * self.layout.bytes_per_token // self.layout.itemsize,
                                     dtype=self.mem_pool_host.dtype)
            page = self._flat_as_page(target)
            out.append(target if page is not None and self._copy_page(view, page) else None)
        return out

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None) -> bool:
        """Store flat pages; True only if every page is stored (or already was)."""
        if self.layout is None:
            logger.error("batch_set before register_mem_pool_host: nothing stored")
            return False
        if values is None or len(values) != len(keys):
            logger.error("batch_set needs one value per key (%d keys)", len(keys))
            return False
        pages = [self._flat_as_page(v) for v in values]
        if any(p is None for p in pages):
            self.stats["set_failed"] += len(keys)
            return False
        return all(self._put(keys, [self._encode(p, k) for p, k in zip(pages, keys)]))

    def _put(self, keys: List[str], blobs: list[bytearray]) -> list[bool]:
        try:
            results = self.client.put_batch([(self.pool_key(k), b) for k, b in zip(keys, blobs)])
        except KVPoolError as exc:
            results = [exc] * len(keys)
        ok = [r is None for r in results]
        for key, r in zip(keys, results):
            if r is not None:
                logger.warning("kvpool put of page %s failed: %s", key, r)
        self.stats["set_ok"] += sum(ok)
        self.stats["set_failed"] += len(ok) - sum(ok)
        return ok

    def exists(self, key: str) -> bool:
        try:
            return self.client.exists(self.pool_key(key))
        except KVPoolError as exc:
            logger.warning("kvpool exists(%s) failed: %s", key, exc)
            return False

    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        """How many of `keys`, from the first, are stored: one `match_prefix` round trip."""
        if not keys:
            return 0
        try:
            return self.client.match_prefix([self.pool_key(k) for k in keys])
        except KVPoolError as exc:
            logger.warning("kvpool match_prefix of %d pages failed: %s", len(keys), exc)
            return 0

    # ---- zero-copy page interface (host pool indices) ----

    def batch_get_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        """Read pages straight into the host pool at `host_indices` (page i at host_indices[i * page_size])."""
        try:
            starts = self._pages_at(keys, host_indices)
            views = self._read_pages(keys)
        except (KVPoolError, TypeError, AttributeError) as exc:
            logger.warning("kvpool batch_get_v1 of %d pages failed: %s", len(keys), exc)
            return [False] * len(keys)
        return [self._copy_page(v, self._host_page(s)) for v, s in zip(views, starts)]

    def batch_set_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        """Write pages straight from the host pool; pages already stored are not re-sent."""
        try:
            starts = self._pages_at(keys, host_indices)
            present = self.client.exists_batch([self.pool_key(k) for k in keys])
        except (KVPoolError, TypeError, AttributeError) as exc:
            logger.warning("kvpool batch_set_v1 of %d pages failed: %s", len(keys), exc)
            return [False] * len(keys)
        todo = [i for i, p in enumerate(present) if not p]
        result = [True] * len(keys)
        if todo:
            ok = self._put([keys[i] for i in todo], [self._encode(self._host_page(starts[i]), keys[i]) for i in todo])
            for i, good in zip(todo, ok):
                result[i] = good
        return result

    # ---- v2 interface (per-pool transfers, for SGLang's hybrid models) ----
    # SGLang 0.5.23 moves KV pages through v1 and the host pools next to them (sliding-window KV,
    # DSA indexer, ...) through these, keyed by the KV page hashes. A pool with K/V pages in a host
    # layout is stored as chunk objects of its own layout, in a namespace salted with the pool's
    # name; the KV pool ("kv") is this backend itself, so v1 and v2 share its pages.

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Register a host pool by name. A pool kvpool cannot store (Mamba state: not K/V pages)
        raises `InvalidArgument`: every prefix that needs it would miss."""
        from types import SimpleNamespace

        self.__dict__.setdefault("registered_pools", {})[host_pool_name] = host_pool
        name = str(host_pool_name)  # PoolName is a str enum whose str() is its value
        if name == "kv":
            if self.mem_pool_host is None:
                self.register_mem_pool_host(host_pool)
            return
        config = SimpleNamespace(tp_rank=self.tp_rank, tp_size=self.tp_size, pp_rank=0, is_mla_model=False,
                                 model_name=self.model_id,
                                 extra_config={"model_id": self.model_id, "weights_fingerprint": self.weights_fingerprint,
                                               "tenant_salt": f"{self.tenant_salt}/{name}", "kvpool_address": self.address})
        side = KVPoolHiCacheStorage(config, client=self.client)  # shares this backend's connection
        try:
            side.register_mem_pool_host(host_pool)
        except InvalidArgument as exc:
            raise InvalidArgument(f"kvpool cannot store SGLang host pool {name!r}: {exc}") from None
        self.__dict__.setdefault("_v2_pools", {})[name] = side

    def _v2_store(self, name: Any) -> "KVPoolHiCacheStorage | None":
        return self if str(name) == "kv" else self.__dict__.get("_v2_pools", {}).get(str(name))

    def batch_exists_v2(self, keys: List[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
        """SGLang's `PoolTransferResult`: the KV prefix (pages), cut down by each transfer's pool
        under its hit policy (`all_pages`: every page of the prefix; `trailing_pages`: the last
        len(transfer.keys) pages of it; others: a miss)."""
        kv = self.batch_exists(keys, extra_info)
        hits: dict = {KV_POOL: kv} if kv else {}
        restorable = list(range(1, kv + 1))
        for transfer in pool_transfers or []:
            if not restorable:
                break
            store, policy = self._v2_store(transfer.name), str(getattr(transfer.hit_policy, "value", transfer.hit_policy))
            present = [False] * kv
            if store is not None:
                try:
                    present = store.client.exists_batch([store.pool_key(k) for k in keys[:kv]])
                except KVPoolError as exc:
                    logger.warning("kvpool exists of %d %s pages failed: %s", kv, transfer.name, exc)
            if policy == "all_pages":
                usable = set(range(1, (present.index(False) if False in present else kv) + 1))
            elif policy == "trailing_pages":
                window = max(1, len(transfer.keys or ()))
                usable = {n for n in range(1, kv + 1) if all(present[max(0, n - window):n])}
            else:
                logger.warning("kvpool: hit policy %s of pool %s is not supported: a miss", policy, transfer.name)
                usable = set()
            if usable:
                hits[transfer.name] = max(usable)
            restorable = [n for n in restorable if n in usable]
        return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

    def batch_get_v2(self, transfers: List[Any], extra_info: Any = None) -> dict:
        """Read each transfer's pages into its host pool at its host indices: {pool name: [ok per page]}."""
        return self._batch_v2(transfers, "batch_get_v1")

    def batch_set_v2(self, transfers: List[Any], extra_info: Any = None) -> dict:
        """Write each transfer's pages from its host pool: {pool name: [ok per page]}."""
        return self._batch_v2(transfers, "batch_set_v1")

    def _batch_v2(self, transfers: List[Any], method: str) -> dict:
        results: dict = {}
        for transfer in transfers:
            keys = list(transfer.keys or [])
            store = self._v2_store(transfer.name)
            if store is None:
                logger.warning("kvpool: no host pool %s is registered: %d pages not moved", transfer.name, len(keys))
                results[transfer.name] = [False] * len(keys)
            else:
                results[transfer.name] = getattr(store, method)(keys, transfer.host_indices) if keys else []
        return results

    # ---- lifecycle ----

    def clear(self) -> None:
        """Deliberately a no-op: the pool is shared by every engine; evict through the pool's admin API."""
        logger.info("KVPoolHiCacheStorage.clear() leaves the shared pool untouched")

    def get_stats(self):
        return None  # SGLang expects its own metrics type here; our counters are in `self.stats`

    def close(self) -> None:
        if self._owns_client and self._client is not None:
            self._client.close()
            self._client = None

