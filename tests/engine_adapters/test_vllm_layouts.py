"""How the vLLM connector learns each layer's paged layout from vLLM (FAKE backends mirroring vLLM
0.32 and the older 5-D ones): probed pages, declared shapes, kernel blocks, and what it refuses.
The real CPU backend's page is checked in tests/engine_adapters/vllm_real."""

from __future__ import annotations

import pytest
import torch

from engine_adapters import vllm as conn
from engine_adapters.vllm.layouts import backend_paged_layout
from fakes.vllm_api import FAKE_BACKENDS, FakeAttentionLayer, FakeKVConnectorRole
from kvpool.chunk_format import KVLayout, decode_chunk
from kvpool.errors import InvalidArgument, LayoutMismatch
from vllm_fake_support import BLOCK, CHUNK, DIM, HEADS, LAYERS, engine_for, make_config, pool_chunk_keys, prompts


def test_bad_configuration_is_rejected_clearly(pool):
    with pytest.raises(InvalidArgument, match="multiple of vLLM's block size"):
        conn.KVPoolConnector(make_config(chunk_tokens=24), FakeKVConnectorRole.WORKER, client=pool)
    with pytest.raises(InvalidArgument, match="float16, bfloat16 and float32"):
        conn.KVPoolConnector(make_config(dtype="fp8_e4m3"), FakeKVConnectorRole.WORKER, client=pool)
    worker = conn.KVPoolConnector(make_config(), FakeKVConnectorRole.WORKER, client=pool)
    with pytest.raises(LayoutMismatch):
        worker.register_kv_caches({"l0": torch.zeros(2, 8, BLOCK, HEADS, DIM, dtype=torch.float16)})
    caches = {f"layers.{i}": torch.zeros(2, 8, BLOCK, HEADS, DIM, dtype=torch.float16) for i in range(LAYERS)}
    with pytest.raises(LayoutMismatch, match="set paged_layout"):  # vLLM named no backend: no guessing from shapes
        worker.register_kv_caches(caches)
    worker = conn.KVPoolConnector(make_config(paged_layout="nhd"), FakeKVConnectorRole.WORKER, client=pool)
    caches = {f"layers.{i}": torch.zeros(2, 8, BLOCK, HEADS, DIM + 1, dtype=torch.float16) for i in range(LAYERS)}
    with pytest.raises(LayoutMismatch, match="head_dim=8"):
        worker.register_kv_caches(caches)
    caches = {f"layers.{i}": torch.zeros(2, 8, BLOCK, HEADS, DIM, dtype=torch.float32) for i in range(LAYERS)}
    with pytest.raises(LayoutMismatch, match="dtype"):
        worker.register_kv_caches(caches)


def _worker_with_backend(pool, backend, cfg=None):
    cfg = cfg or make_config()
    for i in range(LAYERS):
        cfg.compilation_config.static_forward_context[f"layers.{i}"] = FakeAttentionLayer(backend)
    return conn.KVPoolConnector(cfg, FakeKVConnectorRole.WORKER, client=pool)


def test_unknown_backends_are_refused_by_name(pool):
    class FakeMlaBackend:  # FAKE: an MLA backend of vLLM 0.32 (latent cache, no K/V split)
        get_name = staticmethod(lambda: "FLASHMLA")

    class FakeLegacyMlaBackend:  # FAKE: an older MLA backend, which declared [blocks, block_size, latent]
        get_name = staticmethod(lambda: "TRITON_MLA")
        get_kv_cache_shape = staticmethod(lambda nb, bs, h, d, cache_dtype_str="auto": (nb, bs, d))

    class FakeCpuWithoutImpl:  # FAKE: CPU_ATTN whose layer offers nothing to probe
        get_name = staticmethod(lambda: "CPU_ATTN")

    caches = {f"layers.{i}": torch.zeros(8, HEADS, BLOCK, 2 * DIM, dtype=torch.float16) for i in range(LAYERS)}
    with pytest.raises(InvalidArgument, match="FLASHMLA"):
        _worker_with_backend(pool, FakeMlaBackend).register_kv_caches(caches)
    with pytest.raises(InvalidArgument, match="TRITON_MLA declares a KV cache of shape"):
        _worker_with_backend(pool, FakeLegacyMlaBackend).register_kv_caches(caches)
    with pytest.raises(LayoutMismatch, match="CPU_ATTN orders K inside its pages by kernel ISA"):
        _worker_with_backend(pool, FakeCpuWithoutImpl).register_kv_caches(caches)
    cfg = make_config()
    worker = _worker_with_backend(pool, FAKE_BACKENDS["kv_last"], cfg)
    cfg.compilation_config.static_forward_context["layers.0"] = FakeAttentionLayer(FAKE_BACKENDS["cpu_vec"])
    with pytest.raises(LayoutMismatch, match="several attention backends"):
        worker.register_kv_caches(caches)


def test_probe_refuses_a_page_it_cannot_invert(pool):
    """A cache-write path that does not store each K and V element exactly once (here: V never,
    as a quantized or latent cache would look) is refused, not guessed."""
    worker = _worker_with_backend(pool, FAKE_BACKENDS["cpu_vec"])
    for layer in worker.worker_side._vllm_config.compilation_config.static_forward_context.values():
        layer.impl.do_kv_cache_update = lambda layer, k, v, cache, slots: cache.view(-1)[: k.numel()].copy_(k.view(-1))
    caches = {f"layers.{i}": torch.zeros(8, HEADS, BLOCK, 2 * DIM, dtype=torch.float16) for i in range(LAYERS)}
    with pytest.raises(LayoutMismatch, match="CPU_ATTN does not store each K and V element"):
        worker.register_kv_caches(caches)


def test_forced_kv_rows_needs_contiguous_pages(pool):
    worker = conn.KVPoolConnector(make_config(paged_layout="kv_rows"), FakeKVConnectorRole.WORKER, client=pool)
    strided = {f"layers.{i}": torch.zeros(8, BLOCK, HEADS, 2 * DIM, dtype=torch.float16).transpose(1, 2)
               for i in range(LAYERS)}
    with pytest.raises(LayoutMismatch, match="contiguous"):
        worker.register_kv_caches(strided)


def test_layers_are_ordered_by_layer_number(pool):
    worker = conn.KVPoolConnector(make_config(paged_layout="nhd"), FakeKVConnectorRole.WORKER, client=pool)
    names = [f"model.layers.{i}.attn" for i in (2, 0, 3, 1)]
    worker.register_kv_caches({n: torch.zeros(2, 4, BLOCK, HEADS, DIM, dtype=torch.float16) for n in names})
    assert worker.worker_side._layers == {f"model.layers.{i}.attn": i for i in range(LAYERS)}


def test_backend_paged_layout():
    """What a backend declares, where its page is not probed (older vLLM; no impl to probe)."""
    for name, backend in FAKE_BACKENDS.items():
        if name != "cpu_vec":
            assert backend_paged_layout(backend, 16, 2, 8) == name
            assert backend_paged_layout(backend, 64, 64, 64) == name, "no ambiguity when dimensions coincide"


@pytest.mark.parametrize("paged_layout", ["cpu_vec", "kv_last", "nhd"])
def test_kernel_blocks(pool, paged_layout):
    """vLLM may split each block into kernel blocks; the registered tensors are kernel-block granular."""
    eng = engine_for(pool, paged_layout, kernel_block_size=BLOCK // 2)
    assert eng.worker.worker_side._kernel_ratio == 2
    p1, p2 = prompts()
    eng.add_request("r1", p1)
    eng.run()
    eng.add_request("r2", p2)
    assert eng.step().matched == {"r2": 64}
    assert torch.equal(eng.read_kv("r2", 0, 64), eng.model_kv("r1")[:64])
    layout = KVLayout(LAYERS, HEADS, DIM, "float16", CHUNK)
    view = decode_chunk(pool.get(pool_chunk_keys(p1)[2]), layout)
    assert torch.equal(view.as_torch(), eng.model_kv("r1")[64:96].permute(1, 2, 3, 0, 4))
    eng.shutdown()
