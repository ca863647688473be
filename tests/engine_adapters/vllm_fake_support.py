"""Helpers shared by the fake-engine vLLM connector tests (test_vllm_connector.py,
test_vllm_layouts.py): the FAKE config of a small model, an engine on it, prompts, pool keys."""

from __future__ import annotations

import random

from engine_adapters import vllm as conn
from fakes.vllm_api import (
    FakeCacheConfig,
    FakeKVTransferConfig,
    FakeModelConfig,
    FakeParallelConfig,
    FakeVllmConfig,
)
from fakes.vllm_engine import FakeVllmEngine
from kvpool.chunk_format import KVLayout
from kvpool.keys import Namespace, chunk_keys_hex

BLOCK, CHUNK, LAYERS, HEADS, DIM = 16, 32, 4, 2, 8


def make_config(dtype: str = "float16", role: str = "kv_both", tp_size: int = 1, **extra) -> FakeVllmConfig:
    extra = {"chunk_tokens": CHUNK, "model_id": "fake/model", "weights_fingerprint": "test-weights", **extra}
    return FakeVllmConfig(
        model_config=FakeModelConfig(model="fake/model", dtype=dtype, num_layers=LAYERS, num_kv_heads=HEADS * tp_size, head_size=DIM),
        cache_config=FakeCacheConfig(block_size=BLOCK),
        parallel_config=FakeParallelConfig(tensor_parallel_size=tp_size),
        kv_transfer_config=FakeKVTransferConfig(kv_role=role, kv_connector_extra_config=extra),
    )


def engine_for(pool, paged_layout="kv_last", dtype="float16", **kw) -> FakeVllmEngine:
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


# the layouts the fake engine plays, each with a dtype to run it in
ALL_LAYOUTS = [("kv_last", "float16"), ("cpu_vec", "bfloat16"), ("nhd", "float32"), ("flashinfer", "bfloat16"),
               ("hnd", "float16")]
