"""The HF adapter runs the adapter conformance suite in float32 and bfloat16 (bit-exact both)."""

from __future__ import annotations

import pytest
import torch
from adapter_conformance import AdapterConformance, ConformanceCase

from engine_adapters.hf import HFAdapter, _cache_layers, forward

pytestmark = pytest.mark.model
CHUNK_TOKENS = 16
_KV_MEMO: dict[tuple, object] = {}


def _equal(a, b, n: int) -> bool:
    la, lb = _cache_layers(a), _cache_layers(b)
    return len(la) == len(lb) and all(_layer_equal(x, y, n) for x, y in zip(la, lb))


def _layer_equal(a, b, n: int) -> bool:
    (ka, va), (kb, vb) = a, b
    return (ka.shape[-2] >= n and kb.shape[-2] >= n and ka.dtype == kb.dtype
            and torch.equal(ka[..., :n, :], kb[..., :n, :]) and torch.equal(va[..., :n, :], vb[..., :n, :]))


class TestHFConformance(AdapterConformance):
    @pytest.fixture(params=["float32", "bfloat16"])
    def case(self, request, pool, damage):
        rm = request.getfixturevalue("reference_model" if request.param == "float32" else "reference_model_bf16")
        def make_kv(ids: list[int]):
            # the suite only reads these caches, so one forward per (dtype, prompt) serves every test
            key = (request.param, tuple(ids))
            if key not in _KV_MEMO:
                _KV_MEMO[key] = forward(rm.model, ids)[1]
            return _KV_MEMO[key]

        return ConformanceCase(
            adapter=HFAdapter(pool, rm.model, rm.namespace(CHUNK_TOKENS)),
            pool=pool,
            make_kv=make_kv,
            kv_equal=_equal,
            layer_kv=lambda cache, i: (cache.layers[i].keys, cache.layers[i].values),
            layer_equal=_layer_equal,
            with_namespace=lambda ns: HFAdapter(pool, rm.model, ns),
            damage=damage,
            vocab_size=rm.model.config.vocab_size,
        )
