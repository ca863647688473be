"""The vLLM KV connector, driven through vLLM's call sequence by a FAKE engine that mirrors vLLM
0.32 (the real CPU build runs in tests/engine_adapters/vllm_real; the fake covers the CUDA
backends' layouts, the older 5-D ones, kernel blocks, preemption and outages).

Real parts: the connector, CPU torch paged KV tensors with random block tables, kvpool chunk keys
and chunk objects, and the pool (the real embedded pool on loopback; the dict-backed
`DictPoolForConnectorTests` only for simulated outages).
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from engine_adapters import vllm as conn
from fakes.dict_pool import DictPoolForConnectorTests
from fakes.vllm_api import FakeCacheConfig, FakeKVConnectorRole, FakeKVTransferConfig, FakeModelConfig, FakeVllmConfig
from fakes.vllm_engine import FakeRequest, FakeVllmEngine
from kvpool.chunk_format import HEADER_SIZE, KVLayout, decode_chunk
from kvpool.client import connect
from kvpool.config import load_settings
from kvpool.embedded import EmbeddedPool
from kvpool.errors import AlreadyExists, Unavailable
from vllm_fake_support import (ALL_LAYOUTS, BLOCK, CHUNK, DIM, HEADS, LAYERS, engine_for, make_config, pool_chunk_keys,
                               prompts)

class CountingClient:
    """Forwards to a pool client and counts calls by method name (a test probe, not a fake)."""

    def __init__(self, inner):
        self._inner, self.calls = inner, {}

    def __getattr__(self, name):
        target = getattr(self._inner, name)
        if not callable(target):
            return target

        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return target(*args, **kwargs)

        return counted


@pytest.fixture
def pool():
    """The pool client the connector talks to: the real embedded pool on loopback."""
    server = EmbeddedPool(load_settings(port=0, admin_port=0, dram_capacity="64MiB")).start()
    client = CountingClient(connect(server.address))
    yield client
    client.close()
    server.stop()


@pytest.mark.parametrize("paged_layout,dtype", ALL_LAYOUTS)
def test_second_request_loads_bit_identical_prefix(pool, paged_layout, dtype):
    eng = engine_for(pool, paged_layout, dtype)
    probed = {"cpu_vec": "probed"}.get(paged_layout, paged_layout)  # vLLM 0.32 pages are probed, named if a view
    assert eng.worker.paged_layout == probed, "from the backend the engine registered"
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


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("paged_layout", [name for name, _ in ALL_LAYOUTS])
def test_paged_cache_on_cuda(pool, paged_layout):
    """Where vLLM really runs: the paged tensors live on the GPU, chunk objects on the host."""
    eng = FakeVllmEngine(make_config("bfloat16"), conn.KVPoolConnector, client=pool, paged_layout=paged_layout,
                         device="cuda")
    p1, p2 = prompts()
    eng.add_request("r1", p1)
    eng.run()
    eng.add_request("r2", p2)
    assert eng.step().matched == {"r2": 64}
    assert torch.equal(eng.read_kv("r2", 0, 64).view(torch.uint8), eng.model_kv("r1")[:64].view(torch.uint8))
    layout = KVLayout(LAYERS, HEADS, DIM, "bfloat16", CHUNK)
    view = decode_chunk(pool.get(pool_chunk_keys(p1, "bfloat16")[2]), layout)
    assert torch.equal(view.as_torch(), eng.model_kv("r1")[64:96].permute(1, 2, 3, 0, 4))
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
    assert len(keys) == 3 and all(pool.exists(k) for k in keys)
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


def test_skipped_layer_hooks_turn_into_load_errors(pool):
    """If the engine never calls wait_for_layer_load (e.g. a captured graph), the load must not
    silently count: its blocks are reported and recomputed."""
    eng = engine_for(pool)
    p1, p2 = prompts()
    eng.add_request("r1", p1)
    eng.run()
    eng.add_request("r2", p2)
    eng.worker.wait_for_layer_load = lambda name: None  # the hook never runs
    step = eng.step()
    r2 = eng.requests["r2"]
    assert step.matched == {"r2": 64} and step.load_errors == set(r2.block_ids[:4])  # the 64 loaded tokens
    assert r2.num_computed_tokens == 0
    eng.run()
    assert torch.equal(eng.read_kv("r2", 0, len(p2)), eng.model_kv("r2"))
    assert conn.KVPoolConnector.requires_piecewise_for_cudagraph({}) is True


def test_local_prefix_cache_hit_loads_only_the_rest(pool):
    """vLLM already holds the first block locally: the connector fills blocks 1..3 only."""
    eng = engine_for(pool)
    p1, p2 = prompts()
    eng.add_request("r1", p1)
    eng.run()
    eng.add_request("r2", p2, local_prefix_tokens=BLOCK, local_fill=7.0)
    step = eng.step()
    assert step.matched == {"r2": 64 - BLOCK}, "counted beyond vLLM's own hit, up to the pool's 2 chunks"
    got = eng.read_kv("r2", 0, 64)
    assert bool((got[:BLOCK] == 7.0).all()), "the locally cached block was not touched"
    assert torch.equal(got[BLOCK:], eng.model_kv("r2")[BLOCK:64])
    assert torch.equal(eng.read_kv("r2", 64, len(p2)), eng.model_kv("r2")[64:])


def test_preempted_request_resumes_with_its_saved_chunks(pool):
    eng = engine_for(pool, token_budget=40)
    p1, _ = prompts()
    keys = pool_chunk_keys(p1)
    eng.add_request("r1", p1)
    eng.step()  # 40 tokens computed: chunk 0 saved
    assert [pool.exists(k) for k in keys] == [True, False, False]
    eng.preempt("r1")
    step = eng.step()  # resumed: a cached request with new blocks, chunk 0 comes from the pool
    assert step.matched == {"r1": 32}
    assert step.output.scheduled_cached_reqs.resumed_req_ids == {"r1"} and not step.output.scheduled_new_reqs
    eng.run()
    assert all(pool.exists(k) for k in keys)
    assert torch.equal(eng.read_kv("r1", 0, len(p1)), eng.model_kv("r1"))
    assert eng.worker.stats["loaded_chunks"] == 1


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


def corrupt(pool, key, offset=HEADER_SIZE + 36):
    data = bytearray(pool.get(key))
    data[offset] ^= 0xFF  # a payload byte: the header's checksum no longer matches
    getattr(pool, "flush", lambda: None)()  # the real client unpins what it read on its next call
    pool.remove(key)
    for _ in range(200):  # the real pool finishes a remove asynchronously: "retry later"
        try:
            return pool.put(key, data)
        except AlreadyExists:
            time.sleep(0.01)
    raise AssertionError(f"could not re-put {key}")


def test_damaged_chunk_is_a_miss_removed_and_healed_by_a_later_save(pool):
    eng = engine_for(pool)
    p1, _ = prompts()
    eng.add_request("r1", p1)
    eng.run()
    keys = pool_chunk_keys(p1)
    corrupt(pool, keys[1])
    events = []
    eng.worker.add_listener(events.append)
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
    assert [(e.kind, e.keys) for e in events] == [("removed", [keys[1]])]

    # the next request with that prefix loads chunk 0, recomputes and saves chunk 1: healed
    eng.add_request("r3", p1 + [4, 5])
    assert eng.step().matched == {"r3": 32}
    eng.run()
    assert pool.exists(keys[1]) and any(e.kind == "stored" and keys[1] in e.keys for e in events)
    eng.add_request("r4", p1 + [6])
    step = eng.step()
    assert step.matched == {"r4": 96} and not step.load_errors
    assert torch.equal(eng.read_kv("r4", 0, 96), eng.model_kv("r1")[:96])


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
    cons = engine_for(pool, role="kv_consumer")
    cons.add_request("r1", p1)
    cons.run()
    assert not any(pool.exists(k) for k in pool_chunk_keys(p1)), "a consumer does not save"

    prod = engine_for(pool, role="kv_producer")
    prod.add_request("r1", p1)
    finished = {rid: ans for r in prod.run() for rid, ans in r.finished.items()}
    assert finished["r1"] == (False, {"kvpool_cached_tokens": 96, "kvpool_chunk_tokens": CHUNK})
    prod.add_request("r2", p2)
    assert prod.step().matched == {"r2": 0}, "a producer does not load"
    cons.add_request("r3", p2)
    assert cons.step().matched == {"r3": 96}, "a consumer loads what the producer saved (r1 and r2)"


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
    class DownPool(DictPoolForConnectorTests):  # FAKE outage: the real client would wait for timeouts
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


def test_connects_to_the_pool_by_address():
    """The deployment path: no injected client, `kvpool_address` from the extra config."""
    server = EmbeddedPool(load_settings(port=0, admin_port=0, dram_capacity="64MiB")).start()
    client = connect(server.address)
    try:
        cfg = make_config(kvpool_address=server.address)
        eng = FakeVllmEngine(cfg, conn.KVPoolConnector, client=None)
        p1, p2 = prompts()
        eng.add_request("r1", p1)
        eng.run()
        assert all(client.exists(k) for k in pool_chunk_keys(p1))
        eng.add_request("r2", p2)
        assert eng.step().matched == {"r2": 64}
        assert torch.equal(eng.read_kv("r2", 0, 64), eng.model_kv("r1")[:64])
        eng.shutdown()
    finally:
        client.close()
        server.stop()


# ---- one format: the vLLM connector and the HF reference adapter read each other's chunks ----


@pytest.mark.model
def test_vllm_connector_and_hf_adapter_share_chunks(pool, reference_model):
    from engine_adapters.hf import HFAdapter, forward

    rm = reference_model
    ns = rm.namespace(chunk_tokens=16)
    lay = ns.layout
    cfg = FakeVllmConfig(
        model_config=FakeModelConfig(model=ns.model_id, dtype=lay.dtype, num_layers=lay.num_layers,
                                     num_kv_heads=lay.kv_heads, head_size=lay.head_dim),
        cache_config=FakeCacheConfig(block_size=16),
        kv_transfer_config=FakeKVTransferConfig(kv_connector_extra_config={
            "chunk_tokens": 16, "model_id": ns.model_id, "weights_fingerprint": ns.weights_fingerprint}))
    hf = HFAdapter(pool, rm.model, ns)
    rng = random.Random(5)

    # vLLM saves -> HF loads
    ids = [rng.randrange(1, 40_000) for _ in range(40)]
    eng = FakeVllmEngine(cfg, conn.KVPoolConnector, client=pool)
    eng.add_request("r1", ids)
    eng.run()
    res = hf.load(ids)
    assert res.num_tokens == 32
    want = eng.model_kv("r1")[:32]  # [tokens, layers, 2, heads, dim]
    for i, layer in enumerate(res.cache.layers):
        assert torch.equal(layer.keys[0], want[:, i, 0].transpose(0, 1))
        assert torch.equal(layer.values[0], want[:, i, 1].transpose(0, 1))

    # HF saves (a real forward pass) -> vLLM loads into its paged blocks
    ids2 = [rng.randrange(1, 40_000) for _ in range(33)]
    cache = forward(rm.model, ids2)[1]
    assert hf.save(ids2, cache).stored_chunks == 2
    eng.add_request("r2", ids2)
    assert eng.step().matched == {"r2": 32}
    got = eng.read_kv("r2", 0, 32)
    for i, layer in enumerate(cache.layers):
        assert torch.equal(got[:, i, 0], layer.keys[0, :, :32].transpose(0, 1))
        assert torch.equal(got[:, i, 1], layer.values[0, :, :32].transpose(0, 1))
    eng.shutdown()
