"""KVPoolHiCacheStorage against the real `sglang` package's HiCacheStorage (sglang 0.5.23, installed
into .venv-vllm without its dependencies by `make vllm-env`; its storage module then imports).

Real: SGLang's abstract base class, its config and v2 transfer types (`HiCacheStorageConfig`,
`PoolTransfer`, `PoolName`, `PoolHitPolicy`, `PoolTransferResult`), its `StorageBackendFactory`
(loading the backend from docs/sglang.md's dynamic config), the backend, a `kvpool serve` on
loopback. FAKE: the host KV pools (tests/engine_adapters/fakes/sglang_host.py): SGLang's own
`MHATokenToKVPoolHost` does not import here (`sglang.srt.mem_cache.pool_host.mha` pulls in the
multimodal model configs, which import torchvision; PyPI's torchvision for torch 2.13 is a CUDA
build that breaks `import vllm` in this environment) and wants device KV buffers to mirror.
"""

from __future__ import annotations

import importlib.util
import inspect

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                reason="sglang is not installed here: `make vllm-env` installs it into .venv-vllm")

LAYERS, HEADS, DIM, PAGE, SIZE = 3, 2, 8, 4, 64


@pytest.fixture(scope="module")
def real():
    return importlib.import_module("sglang.srt.mem_cache.hicache_storage")


@pytest.fixture
def backend(real, pool_address, request):
    from engine_adapters.sglang import KVPoolHiCacheStorage
    from fakes.sglang_host import FakeMHATokenToKVPoolHost

    config = real.HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name="test/model",
        extra_config={"kvpool_address": pool_address, "weights_fingerprint": f"w-{request.node.name}"})
    storage = KVPoolHiCacheStorage(config, {})
    storage.register_mem_pool_host(FakeMHATokenToKVPoolHost(LAYERS, HEADS, DIM, SIZE, PAGE, "page_first"))
    yield storage
    storage.close()


def test_subclasses_the_real_base_and_implements_its_interface(real):
    from engine_adapters import sglang as mod

    assert mod.SGLANG_AVAILABLE and issubclass(mod.KVPoolHiCacheStorage, real.HiCacheStorage)
    assert not inspect.isabstract(mod.KVPoolHiCacheStorage), "every abstract method of HiCacheStorage is defined"
    methods = [n for n, f in vars(real.HiCacheStorage).items() if inspect.isfunction(f) and not n.startswith("_")]
    assert {"batch_get_v2", "batch_set_v2", "batch_exists_v2", "batch_get_v1", "batch_set_v1"} <= set(methods)
    for name in methods:
        ours = getattr(mod.KVPoolHiCacheStorage, name)
        if ours is getattr(real.HiCacheStorage, name):
            continue  # inherited as is
        base = [p.name for p in inspect.signature(getattr(real.HiCacheStorage, name)).parameters.values()]
        mine = [p.name for p in inspect.signature(ours).parameters.values() if p.kind != p.KEYWORD_ONLY]
        assert mine == base, f"{name}: our parameters {mine}, SGLang's {base} (SGLang calls some by keyword)"
    for name in ("batch_get_v2", "batch_set_v2", "batch_exists_v2"):
        assert getattr(mod.KVPoolHiCacheStorage, name) is not getattr(real.HiCacheStorage, name), f"{name} implemented"


def _fill(host, pages: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in pages:
        host.set_from_flat_data_page(p * PAGE, torch.randn(host.get_dummy_flat_data_page().shape, generator=g).to(host.dtype))


def _indices(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


def test_v2_round_trip_of_kv_and_a_side_pool(real, backend):
    """KV pages through v2 (the same pages as v1) and an SWA-like side pool of its own geometry."""
    from fakes.sglang_host import FakeMHATokenToKVPoolHost

    swa = FakeMHATokenToKVPoolHost(1, HEADS, DIM, SIZE, PAGE, "layer_first")
    backend.register_mem_host_pool_v2(swa, real.PoolName.SWA)
    keys = [f"page-{i}" for i in range(3)]
    _fill(backend.mem_pool_host, [0, 1, 2], seed=1)
    _fill(swa, [4, 5, 6], seed=2)
    put = backend.batch_set_v2([real.PoolTransfer(name=real.PoolName.KV, host_indices=_indices([0, 1, 2]), keys=keys),
                                real.PoolTransfer(name=real.PoolName.SWA, host_indices=_indices([4, 5, 6]), keys=keys)])
    assert put == {real.PoolName.KV: [True] * 3, real.PoolName.SWA: [True] * 3}
    assert backend.batch_exists(keys) == 3, "v1 sees the KV pages v2 wrote"

    kv_before, swa_before = backend.mem_pool_host.kv_buffer.clone(), swa.kv_buffer.clone()
    got = backend.batch_get_v2([real.PoolTransfer(name=real.PoolName.KV, host_indices=_indices([8, 9, 10]), keys=keys),
                                real.PoolTransfer(name=real.PoolName.SWA, host_indices=_indices([12, 13, 14]), keys=keys)])
    assert got == {real.PoolName.KV: [True] * 3, real.PoolName.SWA: [True] * 3}
    for a, b in zip([0, 1, 2], [8, 9, 10]):
        assert torch.equal(backend.mem_pool_host.get_data_page(b * PAGE), kv_before[:, a * PAGE:(a + 1) * PAGE].flatten())
    for a, b in zip([4, 5, 6], [12, 13, 14]):
        assert torch.equal(swa.get_data_page(b * PAGE), swa_before[:, :, a * PAGE:(a + 1) * PAGE].flatten())
    missing = backend.batch_get_v2([real.PoolTransfer(name=real.PoolName.SWA, host_indices=_indices([1]), keys=["nope"])])
    assert missing == {real.PoolName.SWA: [False]}


def test_v2_exists_applies_the_hit_policies(real, backend):
    """KV pages 0..3 stored; the side pool holds pages 0, 1 and 3 only: all_pages stops at 2, a
    one-page trailing window can end after page 2 or 4 (not 3), and the result intersects them."""
    from fakes.sglang_host import FakeMHATokenToKVPoolHost

    side = FakeMHATokenToKVPoolHost(1, HEADS, DIM, SIZE, PAGE, "page_first")
    backend.register_mem_host_pool_v2(side, real.PoolName.SWA)
    keys = [f"k{i}" for i in range(5)]
    _fill(backend.mem_pool_host, [0, 1, 2, 3], seed=3)
    _fill(side, [0, 1, 3], seed=4)
    assert all(backend.batch_set_v1(keys[:4], _indices([0, 1, 2, 3])))
    swa_keys = [keys[0], keys[1], keys[3]]
    assert backend.batch_set_v2([real.PoolTransfer(name=real.PoolName.SWA, host_indices=_indices([0, 1, 3]),
                                                   keys=swa_keys)]) == {real.PoolName.SWA: [True] * 3}

    plain = backend.batch_exists_v2(keys, [])
    assert isinstance(plain, real.PoolTransferResult) and plain.kv_hit_pages == 4
    every = backend.batch_exists_v2(keys, [real.PoolTransfer(name=real.PoolName.SWA, keys=keys)])
    assert (every.kv_hit_pages, every.extra_pool_hit_pages[real.PoolName.SWA]) == (2, 2)
    trailing = backend.batch_exists_v2(keys, [real.PoolTransfer(name=real.PoolName.SWA, keys=keys[-1:],
                                                                 hit_policy=real.PoolHitPolicy.TRAILING_PAGES)])
    assert trailing.kv_hit_pages == 4 and trailing.restorable_prefix_pages == [1, 2, 4]
    unknown = backend.batch_exists_v2(keys, [real.PoolTransfer(name=real.PoolName.MAMBA, keys=keys)])
    assert unknown.kv_hit_pages == 0, "a pool nobody registered holds nothing"


def test_a_pool_that_is_not_kv_pages_is_refused(real, backend):
    from kvpool.errors import InvalidArgument

    class MambaStatePool:  # no K/V page geometry (layer_num, head_num, head_dim, page_size)
        layout, dtype = "layer_first", torch.float16

    with pytest.raises(InvalidArgument, match="mamba"):
        backend.register_mem_host_pool_v2(MambaStatePool(), real.PoolName.MAMBA)


def test_sglang_creates_it_from_the_documented_dynamic_config(real, pool_address):
    """SGLang's own StorageBackendFactory loads the backend from docs/sglang.md's extra config."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from engine_adapters.sglang import KVPoolHiCacheStorage
    from fakes.sglang_host import FakeMHATokenToKVPoolHost

    extra = {"backend_name": "kvpool", "module_path": "engine_adapters.sglang", "class_name": "KVPoolHiCacheStorage",
             "interface_v1": 1, "kvpool_address": pool_address, "weights_fingerprint": "factory-test"}
    config = real.HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name="test/model", extra_config=extra)
    host = FakeMHATokenToKVPoolHost(LAYERS, HEADS, DIM, SIZE, PAGE, "page_first")
    storage = StorageBackendFactory.create_backend("dynamic", config, host)
    try:
        assert isinstance(storage, KVPoolHiCacheStorage)
        storage.register_mem_pool_host(host)  # what SGLang's cache controller does next
        _fill(host, [0], seed=5)
        assert storage.batch_set_v1(["factory-page"], _indices([0])) == [True]
        assert storage.batch_exists(["factory-page"]) == 1
    finally:
        storage.close()
