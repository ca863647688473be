"""The SGLang HiCache storage backend against the pool, with a FAKE host KV pool (SGLang needs CUDA).

Real parts: the backend, CPU torch host buffers in SGLang's three MHA host layouts, kvpool chunk
objects, and the pool (the real embedded pool on loopback; the dict fake only for simulated outages).
The calls follow HiCacheController's: `batch_exists` on a page-hash chain for prefetch, then
`batch_get_v1` (zero-copy) or `batch_get` (generic); backup with `batch_set_v1` or `batch_set`.
"""

from __future__ import annotations

import hashlib
import importlib

import pytest
import torch

from engine_adapters import sglang as backend_mod
from kvpool.client import connect
from kvpool.config import load_settings
from kvpool.embedded import EmbeddedPool
from kvpool.errors import AlreadyExists, InvalidArgument, Unavailable
from fakes.dict_pool import DictPoolForConnectorTests
from fakes.sglang_api import FakeHiCacheStorageConfig
from fakes.sglang_host import FakeMHATokenToKVPoolHost
from kvpool.chunk_format import KVLayout, decode_chunk

LAYERS, HEADS, DIM, PAGE, SIZE = 3, 2, 8, 4, 64
LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


@pytest.fixture
def pool():
    """The real embedded pool on loopback."""
    server = EmbeddedPool(load_settings(port=0, admin_port=0, dram_capacity="64MiB")).start()
    client = connect(server.address)
    client.server_address = server.address
    yield client
    client.close()
    server.stop()


def make_host(layout="page_first", dtype=torch.float16, seed=0) -> FakeMHATokenToKVPoolHost:
    host = FakeMHATokenToKVPoolHost(LAYERS, HEADS, DIM, SIZE, PAGE, layout, dtype)
    gen = torch.Generator().manual_seed(seed)
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=gen).to(dtype))
    return host


def make_backend(pool, host, **extra) -> backend_mod.KVPoolHiCacheStorage:
    cfg = FakeHiCacheStorageConfig(tp_rank=extra.pop("tp_rank", 0), tp_size=extra.pop("tp_size", 1),
                                   model_name="fake/model", extra_config={"weights_fingerprint": "w1", **extra})
    backend = backend_mod.KVPoolHiCacheStorage(cfg, {}, client=pool)
    backend.register_mem_pool_host(host)
    return backend


def page_hashes(tokens: list[int]) -> list[str]:
    """Keys like SGLang's: a sha256 chain over each page's tokens."""
    keys, prev = [], b""
    for i in range(0, len(tokens) - PAGE + 1, PAGE):
        prev = hashlib.sha256(prev + str(tokens[i:i + PAGE]).encode()).digest()
        keys.append(prev.hex())
    return keys


def page_tokens(host, start: int) -> torch.Tensor:
    """K and V of the page's tokens as [tokens, layers, 2, heads, dim] (independent of the backend)."""
    return torch.stack([host.token_kv(start + t) for t in range(PAGE)])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_zero_copy_pages_roundtrip_across_host_pools(pool, layout, dtype):
    src = make_host(layout, dtype, seed=1)
    keys = page_hashes(list(range(100, 120)))  # 5 pages
    src_idx = torch.arange(8, 8 + 5 * PAGE)  # pages at host slots 8..27
    writer = make_backend(pool, src)
    assert writer.batch_set_v1(keys, src_idx) == [True] * 5

    dst = FakeMHATokenToKVPoolHost(LAYERS, HEADS, DIM, SIZE, PAGE, layout, dtype)
    reader = make_backend(pool, dst)
    assert reader.batch_exists(keys) == 5
    dst_idx = torch.arange(40, 40 + 5 * PAGE)
    assert reader.batch_get_v1(keys, dst_idx) == [True] * 5
    for p in range(5):
        assert torch.equal(page_tokens(dst, 40 + p * PAGE), page_tokens(src, 8 + p * PAGE))
    assert torch.count_nonzero(page_tokens(dst, 0)) == 0, "slots outside the target pages stay untouched"


def test_pages_are_kvpool_chunk_objects(pool):
    host = make_host("page_first")
    backend = make_backend(pool, host)
    keys = page_hashes(list(range(8)))
    assert backend.batch_set_v1(keys, torch.arange(0, 2 * PAGE)) == [True, True]
    layout = KVLayout(LAYERS, HEADS, DIM, "float16", PAGE)
    for p, key in enumerate(keys):
        assert backend.pool_key(key).startswith("sglang/") and key in backend.pool_key(key)
        view = decode_chunk(pool.get(backend.pool_key(key)), layout)
        want = page_tokens(host, p * PAGE).permute(1, 2, 3, 0, 4)  # -> [layers, 2, heads, tokens, dim]
        assert torch.equal(view.as_torch(), want)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_generic_get_set_roundtrip(pool, layout):
    host = make_host(layout)
    backend = make_backend(pool, host)
    keys = page_hashes(list(range(50, 62)))  # 3 pages
    pages = [host.get_data_page(i * PAGE, flat=True) for i in range(3)]
    assert backend.set(keys[0], pages[0]) is True
    assert backend.batch_set(keys[1:], pages[1:]) is True
    assert backend.exists(keys[2]) and not backend.exists("0" * 64)

    got = backend.get(keys[0], host.get_dummy_flat_data_page())
    assert torch.equal(got, pages[0])
    targets = [host.get_dummy_flat_data_page() for _ in range(4)]
    out = backend.batch_get(keys + ["f" * 64], targets)
    assert [o is None for o in out] == [False, False, False, True]
    for o, page, target in zip(out, pages, targets):
        assert o is target and torch.equal(o, page)
    assert torch.equal(backend.get(keys[1]), pages[1])  # no target: a fresh page


def test_host_layouts_share_pages(pool):
    """A page written from a layer_first host pool reads back into a page_first one."""
    a, b = make_host("layer_first", seed=3), FakeMHATokenToKVPoolHost(LAYERS, HEADS, DIM, SIZE, PAGE, "page_first")
    keys = page_hashes(list(range(4)))
    make_backend(pool, a).batch_set_v1(keys, torch.arange(12, 12 + PAGE))
    assert make_backend(pool, b).batch_get_v1(keys, torch.arange(0, PAGE)) == [True]
    assert torch.equal(page_tokens(b, 0), page_tokens(a, 12))


def test_missing_pages_and_prefix_semantics(pool):
    host = make_host()
    backend = make_backend(pool, host)
    keys = page_hashes(list(range(16)))  # 4 pages
    backend.batch_set_v1([keys[0], keys[1], keys[3]], torch.cat([torch.arange(0, 8), torch.arange(12, 16)]))
    assert backend.batch_exists(keys) == 2, "consecutive from the first key"
    assert backend.batch_exists([]) == 0
    dst = FakeMHATokenToKVPoolHost(LAYERS, HEADS, DIM, SIZE, PAGE, "page_first")
    reader = make_backend(pool, dst)
    assert reader.batch_get_v1(keys, torch.arange(0, 16)) == [True, True, False, True]
    assert torch.count_nonzero(page_tokens(dst, 8)) == 0, "a miss leaves the host page untouched"
    assert reader.get(keys[2], host.get_dummy_flat_data_page()) is None


def test_damaged_page_is_a_miss_removed_and_healed_by_a_later_backup(pool):
    host = make_host()
    backend = make_backend(pool, host)
    keys = page_hashes(list(range(8)))
    backend.batch_set_v1(keys, torch.arange(0, 8))
    pk = backend.pool_key(keys[1])
    data = bytearray(pool.get(pk))
    data[-1] ^= 0x01
    getattr(pool, "flush", lambda: None)()
    pool.remove(pk)
    for _ in range(200):
        try:
            pool.put(pk, data)
            break
        except AlreadyExists:  # the real pool finishes a remove asynchronously
            import time

            time.sleep(0.01)
    dst = FakeMHATokenToKVPoolHost(LAYERS, HEADS, DIM, SIZE, PAGE, "page_first")
    reader = make_backend(pool, dst)
    assert reader.batch_get_v1(keys, torch.arange(16, 24)) == [True, False]
    assert torch.count_nonzero(page_tokens(dst, 20)) == 0, "nothing of a damaged page is copied"
    assert reader.stats["corrupt"] == 1
    assert not pool.exists(pk), "the damaged copy is removed (a put never overwrites)"
    assert reader.get(keys[1], host.get_dummy_flat_data_page()) is None
    assert reader.batch_exists(keys) == 1
    assert backend.batch_set_v1(keys, torch.arange(0, 8)) == [True, True], "the next backup stores it again"
    assert reader.batch_get_v1(keys, torch.arange(16, 24)) == [True, True]
    assert torch.equal(page_tokens(dst, 20), page_tokens(host, 4))


def test_namespaces_keep_ranks_and_models_apart(pool):
    host = make_host()
    keys = page_hashes(list(range(4)))
    make_backend(pool, host).batch_set_v1(keys, torch.arange(0, PAGE))
    assert make_backend(pool, host).batch_exists(keys) == 1
    assert make_backend(pool, host, tp_rank=1, tp_size=2).batch_exists(keys) == 0
    assert make_backend(pool, host, weights_fingerprint="w2").batch_exists(keys) == 0
    other_dtype = make_host(dtype=torch.bfloat16)
    assert make_backend(pool, other_dtype).batch_exists(keys) == 0


def test_existing_pages_are_not_resent(pool):
    host = make_host()
    backend = make_backend(pool, host)
    keys = page_hashes(list(range(8)))
    backend.batch_set_v1(keys[:1], torch.arange(0, PAGE))
    before = backend.stats["set_ok"]
    assert backend.batch_set_v1(keys, torch.arange(0, 2 * PAGE)) == [True, True]
    assert backend.stats["set_ok"] - before == 1


def test_bad_input_never_raises_on_io_threads(pool):
    host = make_host()
    backend = make_backend(pool, host)
    assert backend.set("k", torch.zeros(7, dtype=torch.float16)) is False  # wrong size
    assert backend.set("k", host.get_data_page(0).float()) is False  # wrong dtype
    assert backend.batch_set(["a", "b"], [host.get_data_page(0)]) is False  # one value short
    assert backend.batch_get_v1(["a", "b"], torch.arange(0, PAGE)) == [False, False]  # too few indices
    assert backend.batch_get_v1(["a"], torch.arange(1, 1 + PAGE)) == [False]  # not page-aligned
    unregistered = backend_mod.KVPoolHiCacheStorage(FakeHiCacheStorageConfig(), {}, client=pool)
    assert unregistered.get("a") is None and unregistered.exists("a") is False
    assert unregistered.set("a", host.get_data_page(0)) is False


def test_pool_outage_is_a_miss():
    class DownPool(DictPoolForConnectorTests):  # FAKE outage: the real client would wait for timeouts
        def get_batch(self, keys):
            raise Unavailable("pool down")

        def match_prefix(self, keys):
            raise Unavailable("pool down")

        def put_batch(self, items, *, replicas=None):
            raise Unavailable("pool down")

    host = make_host()
    backend = make_backend(DownPool(), host)
    keys = page_hashes(list(range(8)))
    assert backend.batch_set_v1(keys, torch.arange(0, 8)) == [False, False]
    assert backend.batch_set(keys, [host.get_data_page(0), host.get_data_page(4)]) is False
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get_v1(keys, torch.arange(0, 8)) == [False, False]
    assert backend.get(keys[0]) is None


def test_configuration_errors_are_typed(pool):
    with pytest.raises(InvalidArgument, match="MLA"):
        backend_mod.KVPoolHiCacheStorage(FakeHiCacheStorageConfig(is_mla_model=True), {}, client=pool)
    backend = backend_mod.KVPoolHiCacheStorage(FakeHiCacheStorageConfig(), {}, client=pool)
    host = make_host()
    host.layout = "page_head"
    with pytest.raises(InvalidArgument, match="layout"):
        backend.register_mem_pool_host(host)
    host = make_host()
    host.dtype = torch.int8
    with pytest.raises(InvalidArgument, match="dtype"):
        backend.register_mem_pool_host(host)


def test_dynamic_backend_loading_like_sglangs_factory(pool):
    """SGLang's factory imports module_path.class_name and calls cls(storage_config, kwargs)."""
    extra = {"backend_name": "kvpool", "module_path": "engine_adapters.sglang",
             "class_name": "KVPoolHiCacheStorage", "interface_v1": 1}
    cls = getattr(importlib.import_module(extra["module_path"]), extra["class_name"])
    assert issubclass(cls, backend_mod.HiCacheStorage)
    backend = cls(FakeHiCacheStorageConfig(model_name="m", extra_config=extra), {})
    assert backend.address == "127.0.0.1:7600" and backend._client is None  # connects on first use
    backend.register_mem_pool_host(make_host())
    assert backend.layout == KVLayout(LAYERS, HEADS, DIM, "float16", PAGE)


def test_connects_to_the_pool_by_address(pool):
    """The deployment path: SGLang builds the backend from extra config alone; it connects itself."""
    address = getattr(pool, "server_address", None)
    if address is None:
        pytest.skip("the embedded pool is not available")
    cfg = FakeHiCacheStorageConfig(model_name="fake/model", extra_config={"kvpool_address": address, "interface_v1": 1})
    backend = backend_mod.KVPoolHiCacheStorage(cfg, {})
    host = make_host()
    backend.register_mem_pool_host(host)
    keys = page_hashes(list(range(8)))
    assert backend.batch_set_v1(keys, torch.arange(0, 8)) == [True, True]
    assert pool.exists(backend.pool_key(keys[1]))
    backend.close()
