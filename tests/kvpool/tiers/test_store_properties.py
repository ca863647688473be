"""Model-based property tests of TieredStore: capacity never exceeded, pinned objects never
evicted, every visible object reads back exactly."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.errors import AllPinned, CapacityError, ObjectTooLarge
from kvpool.tiers import TieredStore

KEYS = [f"k{i}" for i in range(10)]


def _value(key: str, size: int) -> bytes:
    seed = hashlib.sha256(f"{key}/{size}".encode()).digest()
    return (seed * (size // 32 + 1))[:size]


ops = st.lists(st.one_of(
    st.tuples(st.just("put"), st.sampled_from(KEYS), st.integers(1, 40_000)),
    st.tuples(st.just("get"), st.sampled_from(KEYS), st.just(0)),
    st.tuples(st.just("pin"), st.sampled_from(KEYS), st.just(0)),
    st.tuples(st.just("unpin"), st.sampled_from(KEYS), st.just(0)),
    st.tuples(st.just("remove"), st.sampled_from(KEYS), st.just(0)),
), max_size=60)


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "arc"])
@pytest.mark.parametrize("with_ssd", [False, True])
@settings(max_examples=40, deadline=None)
@given(program=ops)
def test_store_against_model(tmp_path_factory, policy, with_ssd, program):
    ssd = str(tmp_path_factory.mktemp("ssd")) if with_ssd else None
    store = TieredStore(64 * 1024, ssd_path=ssd, ssd_capacity=128 * 1024, policy=policy)
    sizes: dict[str, int] = {}  # what we put and was not removed (may have been evicted)
    pins: dict[str, int] = {}
    locs: dict = {}
    try:
        for action, key, arg in program:
            if action == "put":
                try:
                    store.put(key, _value(key, arg))
                    if key not in sizes:
                        sizes[key] = arg if not store.contains(key) or store.size_of(key) == arg else store.size_of(key)
                except (AllPinned, CapacityError, ObjectTooLarge):
                    pass
                except Exception as exc:  # AlreadyExists: removed while pinned
                    assert type(exc).__name__ == "AlreadyExists" and pins.get(key)
            elif action == "get":
                got = store.get(key)
                if got is not None:
                    assert got == _value(key, len(got)), "a get returned bytes no put stored"
            elif action == "pin":
                try:
                    loc = store.pin(key)
                    pins[key] = pins.get(key, 0) + 1
                    locs[key] = loc
                    assert bytes(store.arena.buffer[loc.offset : loc.offset + loc.length]) == _value(key, loc.length)
                except (KeyError, CapacityError):
                    pass
            elif action == "unpin" and pins.get(key):
                store.unpin(key)
                pins[key] -= 1
            elif action == "remove":
                store.remove(key)
                sizes.pop(key, None)
            # invariants after every step
            entries = store._entries.values()  # the totals are kept running: they equal a recount
            total = store.stats()["total"]
            assert (total["objects"], total["bytes"], total["pinned"]) == (
                sum(e.visible for e in entries), sum(e.size for e in entries if e.visible),
                sum(e.pins > 0 for e in entries))
            stats = store.stats()["tiers"]
            for tier in stats.values():
                assert tier["used"] <= tier["capacity"]
            for k, n in pins.items():
                if n and store.contains(k):
                    assert dict((kk, t) for kk, _, t in store.keys())[k] == "dram", "a pinned object left DRAM"
            for k, n in pins.items():  # a pinned object's bytes never move or change
                if n:
                    loc = locs[k]
                    assert bytes(store.arena.buffer[loc.offset : loc.offset + loc.length]) == _value(k, loc.length)
            for k, size, _ in store.keys():
                assert k in sizes or pins.get(k), "an object nobody stored is visible"
        for k, n in pins.items():
            for _ in range(n):
                store.unpin(k)
        assert store.stats()["total"]["pinned"] == 0
    finally:
        store.close()
