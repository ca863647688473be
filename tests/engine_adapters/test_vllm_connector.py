"""The vLLM KV connector, driven through vLLM's call sequence by a FAKE engine (vLLM needs CUDA).

Real parts: the connector, CPU torch paged KV tensors with random block tables, kvpool chunk keys
and chunk objects, and the pool (the real embedded pool when it is available, else the
dict-backed `DictPoolForConnectorTests`).
"""

from __future__ import annotations

import random

import pytest
import torch

from engine_adapters import vllm as conn
from engine_adapters._fakes.dict_pool import DictPoolForConnectorTests
from engine_adapters._fakes.vllm_api import (
    FakeCacheConfig,
    FakeKVConnectorRole,
    FakeKVTransferConfig,
    FakeModelConfig,
    FakeParallelConfig,
    FakeVllmConfig,
)
from engine_adapters._fakes.vllm_engine import FakeRequest, FakeVllmEngine
from kvpool.errors import InvalidArgument, LayoutMismatch, Unavailable
from kvpool.keys import Namespace, chunk_keys_hex
from kvpool.layout import KVLayout, decode_chunk

BLOCK, CHUNK, LAYERS, HEADS, DIM = 16, 32, 4, 2, 8


def make_config(dtype: str = "float16", role: str = "kv_both", tp_size: int = 1, **extra) -> FakeVllmConfig:
    extra = {"chunk_tokens": CHUNK, "model_id": "fake/model", "weights_fingerprint": "test-weights", **extra}
    return FakeVllmConfig(
        model_config=FakeModelConfig(model="fake/model", dtype=dtype, num_layers=LAYERS, num_kv_heads=HEADS * tp_size, head_size=DIM),
        cache_config=FakeCacheConfig(block_size=BLOCK),
        parallel_config=FakeParallelConfig(tensor_parallel_size=tp_size),
        kv_transfer_config=FakeKVTransferConfig(kv_role=role, kv_connector_extra_config=extra),
    )


@pytest.fixture
def pool():
    """The pool client the connector talks to (see module docstring)."""
    client = DictPoolForConnectorTests()
    yield client
    client.close()


def engine_for(pool, paged_layout="nhd", dtype="float16", **kw) -> FakeVllmEngine:
    extra = {k: kw.pop(k) for k in list(kw) if k in ("async_save", "load_mode", "paged_layout")}
    return FakeVllmEngine(make_config(dtype, role=kw.pop("role", "kv_both"), **extra), conn.KVPoolConnector,
                          client=pool, paged_layout=paged_layout, **kw)


def prompts(seed=1):
    rng = random.Random(seed)
    p1 = [rng.randrange(1, 50_000) for _ in range(100)]  # 3 full chunks + 4 tokens
    p2 = p1[:80] + [rng.randrange(1, 50_000) for _ in range(30)]  # shares chunks 0 and 1 (64 tokens)
    return p1, p2


def pool_chunk_keys(tokens, dtype="float16", tp_rank=0, tp_size=1):
    layout = KVLayout(LAYERS, HEADS, DIM, dtype, CHUNK)
    ns = Namespace("fake/model", "test-weights", layout, tp_rank, tp_size)
    return chunk_keys_hex(ns.digest(), tokens, CHUNK)


@pytest.mark.parametrize("paged_layout,dtype", [("nhd", "float16"), ("flashinfer", "bfloat16"), ("hnd", "float32")])
def test_second_request_loads_bit_identical_prefix(pool, paged_layout, dtype):
    eng = engine_for(pool, paged_layout, dtype)
    p1, p2 = prompts()
    eng.add_request("r1", p1)
    first = eng.run()
    assert first[0].matched == {"r1": 0}
    assert all(pool.exists(k) for k in pool_chunk_keys(p1, dtype)), "request 1 saved its 3 full chunks"

    eng.add_request("r2", p2)
    step = eng.step()
    assert step.matched == {"r2": 64}  # two shared chunks
    assert not step.load_errors
    r1, r2 = eng.requests["r1"], eng.requests["r2"]
    assert set(r1.block_ids[:4]).isdisjoint(r2.block_ids[:4]), "loaded into other blocks than request 1 used"
    got = eng.read_kv("r2", 0, 64)
    assert torch.equal(got.view(torch.uint8), eng.model_kv("r1")[:64].view(torch.uint8))  # bit-identical
    assert torch.equal(eng.read_kv("r2", 0, len(p2)).view(torch.uint8), eng.model_kv("r2").view(torch.uint8))
    eng.run()
    assert eng.worker.stats["loaded_chunks"] == 2
    eng.shutdown()


def test_pool_objects_are_kvpool_chunk_objects(pool):
    """Keys are kvpool chunk keys and values decode as layer-major chunk objects of the right KV."""
    eng = engine_for(pool)
    p1, _ = prompts()
    eng.add_request("r1", p1)
    eng.run()
    layout = KVLayout(LAYERS, HEADS, DIM, "float16", CHUNK)
    model = eng.model_kv("r1")  # [tokens, layers, 2, heads, dim]
    keys = pool_chunk_keys(p1)
    assert len(keys) == 3 and sorted(pool.keys()) == sorted(keys)
    for i, key in enumerate(keys):
        view = decode_chunk(pool.get(key), layout)
        want = model[i * CHUNK:(i + 1) * CHUNK].permute(1, 2, 3, 0, 4)  # -> [layers, 2, heads, tokens, dim]
        assert view.tokens == CHUNK
        assert torch.equal(view.as_torch(), want)


@pytest.mark.parametrize("load_mode", ["layerwise", "sync"])
def test_layerwise_load(pool, load_mode):
    eng = engine_for(pool, load_mode=load_mode)
    p1, p2 = prompts()
    eng.add_request("r1", p1)
    eng.run()
    eng.add_request("r2", p2)
    seen = []

    def hook(name, phase):
        # at the moment layer i may compute: which layers of r2's loaded prefix are already in place?
        want = eng.model_kv("r2")[:64]
        have = eng.read_kv("r2", 0, 64)
        seen.append([torch.equal(have[:, li], want[:, li]) for li in range(LAYERS)])

    eng.layer_hook = hook
    eng.step()
    if load_mode == "layerwise":  # layer i is loaded exactly when its attention is about to run
        assert seen == [[j <= i for j in range(LAYERS)] for i in range(LAYERS)]
    else:
        assert seen == [[True] * LAYERS] * LAYERS


def test_chunked_prefill_saves_each_chunk_once_computed(pool):
    eng = engine_for(pool, token_budget=40)
    p1, _ = prompts()
    keys = pool_chunk_keys(p1)
    eng.add_request("r1", p1)
    present = []
    for _ in range(3):
        eng.step()
        present.append([pool.exists(k) for k in keys])
    assert present == [[True, False, False], [True, True, False], [True, True, True]]
    assert pool.calls["put_batch"] == 3


def corrupt(pool, key):
    data = bytearray(pool.get(key))
    data[100] ^= 0xFF  # a payload byte: the header's checksum no longer matches
    pool.remove(key)
    pool.put(key, data)


def test_corrupted_chunk_is_a_miss_and_reported(pool):
    eng = engine_for(pool)
    p1, _ = prompts()
    eng.add_request("r1", p1)
    eng.run()
    keys = pool_chunk_keys(p1)
    corrupt(pool, keys[1])
    eng.add_request("r2", p1 + [7, 8, 9])
    step = eng.step()
    r2 = eng.requests["r2"]
    assert step.matched == {"r2": 96}  # the lookup cannot see damage; the load must
    assert step.load_errors == set(r2.block_ids[2:6]), "blocks of chunk 1 and everything after it"
    assert r2.num_computed_tokens == 32, "rolled back to the first failed block"
    assert not pool.exists(keys[1]), "damaged copy dropped"
    assert torch.equal(eng.read_kv("r2", 0, 32), eng.model_kv("r2")[:32])
    eng.run()
    assert torch.equal(eng.read_kv("r2", 0, len(p1) + 3), eng.model_kv("r2"))


def test_async_save_get_finished_semantics(pool):
    eng = engine_for(pool, async_save=True)
    p1, _ = prompts()
    eng.add_request("r1", p1)
    eng.add_request("short", p1[:20])  # no full chunk: nothing to save, never delayed
    results = eng.run()
    done = {rid: ans for r in results for rid, ans in r.finished.items()}
    assert done["r1"][0] is True and done["short"][0] is False
    sending = [r.finished_sending for r in results]
    reported = [rid for s in sending for rid in s]
    assert reported == ["r1"], "reported once, and only the delayed request"
    first_finish = next(i for i, r in enumerate(results) if "r1" in r.finished)
    first_report = next(i for i, r in enumerate(results) if "r1" in r.finished_sending)
    assert first_report > first_finish, "reported only after the scheduler finished it"
    assert not eng.held and len(eng.free_blocks) == 64
    assert all(pool.exists(k) for k in pool_chunk_keys(p1))
    eng.shutdown()


def test_sync_save_never_delays(pool):
    eng = engine_for(pool)
    p1, _ = prompts()
    eng.add_request("r1", p1)
    results = eng.run()
    assert [r.finished.get("r1") for r in results if r.finished] == [(False, None)]
    assert all(not r.finished_sending for r in results)


def test_roles(pool):
    p1, p2 = prompts()
    prod = engine_for(pool, role="kv_producer")
    prod.add_request("r1", p1)
    finished = {rid: ans for r in prod.run() for rid, ans in r.finished.items()}
    assert finished["r1"] == (False, {"kvpool_cached_tokens": 96, "kvpool_chunk_tokens": CHUNK})
    prod.add_request("r2", p2)
    assert prod.step().matched == {"r2": 0}, "a producer does not load"

    cons = engine_for(DictPoolForConnectorTests(), role="kv_consumer")
    cons.add_request("r1", p1)
    cons.run()
    assert cons.worker.client.keys() == [], "a consumer does not save"


def test_tp_ranks_use_distinct_namespaces(pool):
    cfg = make_config(tp_size=2, tp_rank=0)
    eng = FakeVllmEngine(cfg, conn.KVPoolConnector, client=pool)  # only rank 0's worker saves
    p1, _ = prompts()
    eng.add_request("r1", p1)
    eng.run()
    assert all(pool.exists(k) for k in pool_chunk_keys(p1, tp_rank=0, tp_size=2))
    sched = conn.KVPoolConnector(cfg, FakeKVConnectorRole.SCHEDULER, client=pool)
    req = FakeRequest("r9", p1)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False), "rank 1 has nothing: no hit"


def test_pool_errors_are_misses_not_failures():
    class DownPool(DictPoolForConnectorTests):
        def match_prefix(self, keys):
            raise Unavailable("pool down")

        def put_batch(self, items, *, replicas=None):
            raise Unavailable("pool down")

    eng = engine_for(DownPool())
    p1, _ = prompts()
    eng.add_request("r1", p1)
    eng.run()
    assert eng.worker.stats["save_errors"] == 3
    eng.add_request("r2", p1)
    assert eng.step().matched == {"r2": 0}


def test_bad_configuration_is_rejected_clearly(pool):
    with pytest.raises(InvalidArgument, match="multiple of vLLM's block size"):
        conn.KVPoolConnector(make_config(chunk_tokens=24), FakeKVConnectorRole.WORKER, client=pool)
    with pytest.raises(InvalidArgument, match="float16, bfloat16 and float32"):
        conn.KVPoolConnector(make_config(dtype="fp8_e4m3"), FakeKVConnectorRole.WORKER, client=pool)
    worker = conn.KVPoolConnector(make_config(), FakeKVConnectorRole.WORKER, client=pool)
    with pytest.raises(LayoutMismatch):
        worker.register_kv_caches({"l0": torch.zeros(2, 8, BLOCK, HEADS, DIM, dtype=torch.float16)})
    caches = {f"layers.{i}": torch.zeros(2, 8, BLOCK, HEADS, DIM + 1, dtype=torch.float16) for i in range(LAYERS)}
    with pytest.raises(InvalidArgument, match="no supported paged layout"):
        worker.register_kv_caches(caches)
    caches = {f"layers.{i}": torch.zeros(2, 8, BLOCK, HEADS, DIM, dtype=torch.float32) for i in range(LAYERS)}
    with pytest.raises(LayoutMismatch, match="dtype"):
        worker.register_kv_caches(caches)


def test_layers_are_ordered_by_layer_number(pool):
    worker = conn.KVPoolConnector(make_config(), FakeKVConnectorRole.WORKER, client=pool)
    names = [f"model.layers.{i}.attn" for i in (2, 0, 3, 1)]
    worker.register_kv_caches({n: torch.zeros(2, 4, BLOCK, HEADS, DIM, dtype=torch.float16) for n in names})
    assert worker._layers == {f"model.layers.{i}.attn": i for i in range(LAYERS)}


def test_detect_paged_layout():
    assert conn.detect_paged_layout((2, 10, 16, 2, 8), 16, 2, 8) == "nhd"
    assert conn.detect_paged_layout((10, 2, 16, 2, 8), 16, 2, 8) == "flashinfer"
    assert conn.detect_paged_layout((2, 10, 2, 16, 8), 16, 2, 8) == "hnd"
    with pytest.raises(InvalidArgument):
        conn.detect_paged_layout((10, 16, 576), 16, 1, 576)  # MLA
