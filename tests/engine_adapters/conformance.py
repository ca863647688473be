"""The conformance suite every engine adapter runs (contract: `engine_adapters/base.py`).

How to plug an adapter in: in a test file under tests/engine_adapters/ (the conftest there
registers this file as the module `adapter_conformance`), subclass `AdapterConformance` with a
`Test` name and give it a fixture `case` that returns a `ConformanceCase`; parametrize that
fixture for several configurations (dtypes, block sizes). Example (the HF adapter):

    from adapter_conformance import AdapterConformance, ConformanceCase

    class TestHFConformance(AdapterConformance):
        @pytest.fixture(params=["float32", "bfloat16"])
        def case(self, request, pool, ...):
            return ConformanceCase(adapter=..., pool=pool, make_kv=..., kv_equal=..., layer_kv=...,
                                   layer_equal=..., with_namespace=..., damage=pool.damage)

Each test gets a fresh pool. Token ids are random (seeded) and span several full chunks plus a
partial tail, so every path (full chunks, tail, prefix cut) is exercised.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any, Callable

import pytest

from engine_adapters.base import EngineAdapter, KVEvent, LayerwiseLoad, LayerwiseSave
from kvpool.contract import PoolClient
from kvpool.errors import CorruptObject, InvalidArgument, KeyNotFound, LayoutMismatch
from kvpool.handle import KVHandle
from kvpool.keys import Namespace


@dataclass
class ConformanceCase:
    adapter: EngineAdapter
    pool: PoolClient
    make_kv: Callable[[list[int]], Any]  # the engine's KV for exactly these token ids
    kv_equal: Callable[[Any, Any, int], bool]  # bit-for-bit equal on the first n tokens?
    layer_kv: Callable[[Any, int], tuple[Any, Any]]  # (K, V) of layer i of an engine KV
    layer_equal: Callable[[tuple[Any, Any], tuple[Any, Any], int], bool]  # same, for one layer's (K, V)
    with_namespace: Callable[[Namespace], EngineAdapter]  # same engine and pool, another namespace
    damage: Callable[[str], None]  # flip a byte of the stored object under a key
    vocab_size: int = 1000

    def tokens(self, n: int, seed: int = 0) -> list[int]:
        rng = random.Random(seed)
        return [rng.randrange(1, self.vocab_size) for _ in range(n)]


class AdapterConformance:
    """Parametrized behaviour every adapter must show. Subclasses provide the `case` fixture."""

    def _ids(self, case: ConformanceCase, full_chunks: int = 3, tail: int = 5, seed: int = 0) -> list[int]:
        return case.tokens(full_chunks * case.adapter.layout.chunk_tokens + tail, seed)

    def test_save_then_load_is_bit_exact(self, case: ConformanceCase):
        ids = self._ids(case)
        kv = case.make_kv(ids)
        saved = case.adapter.save(ids, kv)
        c = case.adapter.layout.chunk_tokens
        assert saved.keys == case.adapter.chunk_keys(ids) and len(saved.keys) == 3
        assert saved.stored_chunks == 3 and saved.tail_key is None
        assert case.adapter.lookup(ids) == 3 * c
        res = case.adapter.load(ids)
        assert res.num_tokens == 3 * c
        assert case.kv_equal(res.cache, kv, 3 * c)

    def test_nothing_cached_loads_nothing(self, case: ConformanceCase):
        ids = self._ids(case)
        assert case.adapter.lookup(ids) == 0
        res = case.adapter.load(ids)
        assert res.num_tokens == 0 and res.cache is None

    def test_max_tokens_caps_the_prefix_to_whole_chunks(self, case: ConformanceCase):
        ids = self._ids(case)
        c = case.adapter.layout.chunk_tokens
        case.adapter.save(ids, case.make_kv(ids))
        assert case.adapter.lookup(ids, max_tokens=2 * c + 3) == 2 * c
        assert case.adapter.load(ids, max_tokens=2 * c - 1).num_tokens == c
        assert case.adapter.load(ids, max_tokens=0).num_tokens == 0
        with pytest.raises(InvalidArgument):
            case.adapter.load(ids, max_tokens=-1)

    def test_save_writes_only_missing_chunks_and_reports_them(self, case: ConformanceCase):
        events: list[KVEvent] = []
        case.adapter.add_listener(events.append)
        short = self._ids(case, full_chunks=2, tail=0)
        longer = short + case.tokens(case.adapter.layout.chunk_tokens * 2, seed=7)
        first = case.adapter.save(short, case.make_kv(short))
        second = case.adapter.save(longer, case.make_kv(longer))
        assert first.stored_chunks == 2 and second.stored_chunks == 2
        assert second.stored_keys == second.keys[2:]
        assert [e.kind for e in events] == ["stored", "stored"]
        assert events[0].keys == first.keys and events[1].keys == second.keys[2:]
        assert all(e.namespace == case.adapter.namespace.hex() for e in events)
        again = case.adapter.save(longer, case.make_kv(longer))
        assert again.stored_chunks == 0 and len(events) == 2  # nothing new: no event

    def test_start_token_skips_the_loaded_prefix(self, case: ConformanceCase):
        ids = self._ids(case)
        c = case.adapter.layout.chunk_tokens
        saved = case.adapter.save(ids, case.make_kv(ids), start_token=2 * c)
        assert saved.stored_chunks == 1 and saved.stored_keys == [saved.keys[2]]
        assert case.adapter.lookup(ids) == 0  # chunk 0 was never written
        for bad in (1, c + 1, 4 * c, -c):
            with pytest.raises(InvalidArgument):
                case.adapter.save(ids, case.make_kv(ids), start_token=bad)

    def test_handle_carries_full_kv_and_tail(self, case: ConformanceCase):
        ids = self._ids(case, tail=5)
        kv = case.make_kv(ids)
        saved = case.adapter.save(ids, kv, request_id="req-1")
        assert saved.tail_key == "tail/req-1"
        handle = KVHandle.from_json(case.adapter.make_handle(ids, saved).to_json())
        assert handle.num_tokens == len(ids) and handle.tail_key == "tail/req-1"
        loaded = case.adapter.load_handle(handle)
        assert case.kv_equal(loaded, kv, len(ids))
        case.adapter.release_handle(handle)
        assert not case.pool.exists("tail/req-1")
        with pytest.raises(KeyNotFound):
            case.adapter.load_handle(handle)

    def test_handle_without_tail_when_chunks_are_whole(self, case: ConformanceCase):
        ids = self._ids(case, tail=0)
        kv = case.make_kv(ids)
        saved = case.adapter.save(ids, kv, request_id="req-2")
        handle = case.adapter.make_handle(ids, saved)
        assert saved.tail_key is None and handle.tail_key is None
        assert case.kv_equal(case.adapter.load_handle(handle), kv, len(ids))

    def test_partial_tail_needs_a_request_id_for_a_handle(self, case: ConformanceCase):
        ids = self._ids(case, tail=3)
        saved = case.adapter.save(ids, case.make_kv(ids))
        with pytest.raises(InvalidArgument):
            case.adapter.make_handle(ids, saved)

    def test_damaged_chunk_is_a_shorter_prefix_and_gets_restored(self, case: ConformanceCase):
        events: list[KVEvent] = []
        ids = self._ids(case)
        c = case.adapter.layout.chunk_tokens
        kv = case.make_kv(ids)
        saved = case.adapter.save(ids, kv)
        case.adapter.add_listener(events.append)
        case.damage(saved.keys[1])
        res = case.adapter.load(ids)
        assert res.num_tokens == c and case.kv_equal(res.cache, kv, c)
        assert not case.pool.exists(saved.keys[1])  # removed, so it can be stored again
        assert [(e.kind, e.keys) for e in events] == [("removed", [saved.keys[1]])]
        again = case.adapter.save(ids, kv, start_token=res.num_tokens)
        assert again.stored_keys == [saved.keys[1]]
        assert case.kv_equal(case.adapter.load(ids).cache, kv, 3 * c)

    def test_handle_is_all_or_nothing(self, case: ConformanceCase):
        ids = self._ids(case)
        saved = case.adapter.save(ids, case.make_kv(ids), request_id="req-3")
        handle = case.adapter.make_handle(ids, saved)
        case.damage(saved.keys[2])
        with pytest.raises(CorruptObject):
            case.adapter.load_handle(handle)
        case.adapter.save(ids, case.make_kv(ids), request_id="req-3")
        case.damage("tail/req-3")
        with pytest.raises(CorruptObject):
            case.adapter.load_handle(handle)
        case.pool.remove(saved.keys[0])
        with pytest.raises(KeyNotFound):
            case.adapter.load_handle(handle)

    def test_other_tenant_or_model_never_loads(self, case: ConformanceCase):
        ids = self._ids(case)
        saved = case.adapter.save(ids, case.make_kv(ids), request_id="req-4")
        ns = case.adapter.namespace
        others = [replace(ns, tenant_salt=ns.tenant_salt + "-other"),
                  replace(ns, weights_fingerprint="0" * 32),
                  replace(ns, model_id=ns.model_id + "-other")]
        handle = case.adapter.make_handle(ids, saved)
        for other_ns in others:
            other = case.with_namespace(other_ns)
            assert other.chunk_keys(ids) and set(other.chunk_keys(ids)).isdisjoint(saved.keys)
            assert other.lookup(ids) == 0
            assert other.load(ids).num_tokens == 0
            with pytest.raises(LayoutMismatch):
                other.load_handle(handle)

    def test_layerwise_load_matches_load(self, case: ConformanceCase):
        ids = self._ids(case)
        kv = case.make_kv(ids)
        case.adapter.save(ids, kv)
        ld = case.adapter.start_load(ids)
        assert isinstance(ld, LayerwiseLoad)
        n = ld.num_tokens()
        assert n == 3 * case.adapter.layout.chunk_tokens
        for i in reversed(range(case.adapter.layout.num_layers)):
            k, v = ld.wait_layer(i)
            assert case.layer_equal((k, v), case.layer_kv(kv, i), n)
        res = ld.wait()
        assert res.num_tokens == n and case.kv_equal(res.cache, kv, n)

    def test_layerwise_save_matches_save(self, case: ConformanceCase):
        ids = self._ids(case)
        kv = case.make_kv(ids)
        sv = case.adapter.start_save(ids, request_id="req-5")
        assert isinstance(sv, LayerwiseSave)
        for i in range(case.adapter.layout.num_layers):
            sv.save_layer(i, *case.layer_kv(kv, i))
        saved = sv.finish()
        assert saved.stored_chunks == 3 and saved.tail_key == "tail/req-5"
        assert case.kv_equal(case.adapter.load_handle(case.adapter.make_handle(ids, saved)), kv, len(ids))

    def test_layerwise_save_refuses_to_finish_with_missing_layers(self, case: ConformanceCase):
        ids = self._ids(case)
        kv = case.make_kv(ids)
        sv = case.adapter.start_save(ids)
        sv.save_layer(0, *case.layer_kv(kv, 0))
        with pytest.raises(InvalidArgument):
            sv.finish()
        assert case.adapter.lookup(ids) == 0

    def test_bad_input_is_a_typed_error(self, case: ConformanceCase):
        ids = self._ids(case)
        with pytest.raises(InvalidArgument):
            case.adapter.save(ids + ids, case.make_kv(ids))  # the KV is shorter than the token ids
        with pytest.raises(InvalidArgument):
            case.adapter.lookup(["not", "tokens"])
        with pytest.raises(InvalidArgument):
            case.adapter.save(ids, case.make_kv(ids), request_id="a/b")
        with pytest.raises(InvalidArgument):
            KVHandle.from_json(b'{"version": 1}')
        with pytest.raises(InvalidArgument):
            KVHandle.from_json(b"not json")
