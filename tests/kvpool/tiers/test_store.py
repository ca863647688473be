"""TieredStore behaviour: demotion, promotion, pins, two-phase writes, events, bad input."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvpool.errors import AllPinned, AlreadyExists, InvalidArgument, KeyNotFound, ObjectTooLarge
import numpy as np

from kvpool.tiers import TieredStore


def payload(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()

OBJ = 200_000  # 49 pages: five fit in a 1 MiB arena


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "arc"])
def test_demotes_to_ssd_and_promotes_back(make_store, policy):
    store = make_store(ssd=8 << 20, policy=policy)
    events = []
    store.on_event = lambda k, e: events.append((k, e))
    for i in range(12):
        store.put(f"k{i}", payload(OBJ, i))
    tiers = {k: t for k, _, t in store.keys()}
    assert len(tiers) == 12 and set(tiers.values()) == {"dram", "ssd"}
    assert store.stats()["tiers"]["dram"]["used"] <= store.arena.size
    demoted = [k for k, t in tiers.items() if t == "ssd"]
    assert ("k0", "stored") in events and all((k, "demoted") in events for k in demoted)
    for i in range(12):  # every object reads back intact, wherever it lives
        assert store.get(f"k{i}") == payload(OBJ, i)
    assert any(e == "promoted" for _, e in events)
    s = store.stats()
    assert s["tiers"]["ssd"]["hits"] >= len(demoted) and s["tiers"]["dram"]["evictions"] >= len(demoted)
    assert s["total"]["objects"] == 12
    assert s["total"]["hits"] == 12 and s["total"]["misses"] == 0  # each read counted once
    assert s["tiers"]["dram"]["misses"] == s["tiers"]["ssd"]["hits"]
    store.get("absent")
    assert store.stats()["total"]["misses"] == 1


def test_without_ssd_eviction_drops(make_store):
    store = make_store()
    events = []
    store.on_event = lambda k, e: events.append((k, e))
    for i in range(8):
        store.put(f"k{i}", payload(OBJ, i))
    assert ("k0", "removed") in events
    assert store.get("k0") is None and store.get("k7") == payload(OBJ, 7)
    assert store.stats()["tiers"]["dram"]["evictions"] == 3


def test_lru_keeps_recently_read(make_store):
    store = make_store()
    for i in range(5):
        store.put(f"k{i}", payload(OBJ, i))
    store.get("k0")
    store.put("k5", payload(OBJ, 5))
    assert store.contains("k0") and not store.contains("k1")


def test_pinned_object_survives_pressure_and_all_pinned_is_typed(make_store):
    store = make_store()
    for i in range(5):
        store.put(f"k{i}", payload(OBJ, i))
    locs = [store.pin(f"k{i}") for i in range(5)]
    with pytest.raises(AllPinned):
        store.put("new", payload(OBJ, 99))
    assert not store.contains("new")
    for i, loc in enumerate(locs):
        assert bytes(store.arena.buffer[loc.offset : loc.offset + loc.length]) == payload(OBJ, i)
        store.unpin(f"k{i}")
    store.put("new", payload(OBJ, 99))
    assert store.get("new") == payload(OBJ, 99)
    with pytest.raises(InvalidArgument):
        store.unpin("new")  # not pinned


def test_pin_promotes_from_ssd(make_store):
    store = make_store(ssd=4 << 20)
    for i in range(8):
        store.put(f"k{i}", payload(OBJ, i))
    assert dict((k, t) for k, _, t in store.keys())["k0"] == "ssd"
    with store.pinned("k0") as loc:
        assert bytes(store.arena.buffer[loc.offset : loc.offset + loc.length]) == payload(OBJ, 0)
        assert dict((k, t) for k, _, t in store.keys())["k0"] == "dram"
    with pytest.raises(KeyNotFound):
        store.pin("missing")


def test_remove_while_pinned_defers_the_free(make_store):
    store = make_store()
    store.put("a", payload(OBJ, 1))
    loc = store.pin("a")
    used = store.stats()["tiers"]["dram"]["used"]
    assert store.remove("a") is True
    assert not store.contains("a") and store.get("a") is None
    assert store.stats()["tiers"]["dram"]["used"] == used  # bytes still there for the reader
    assert bytes(store.arena.buffer[loc.offset : loc.offset + 100]) == payload(OBJ, 1)[:100]
    with pytest.raises(AlreadyExists):
        store.put("a", b"other")
    store.unpin("a")
    assert store.stats()["tiers"]["dram"]["used"] == 0
    store.put("a", b"other")
    assert store.get("a") == b"other"


def test_two_phase_write(make_store):
    store = make_store()
    res = store.reserve("w", 10_000)
    assert not store.contains("w")
    store.arena.buffer[res.offset : res.offset + res.length] = payload(10_000, 5)
    with pytest.raises(AlreadyExists):
        store.reserve("w", 10)
    store.commit("w")
    assert store.get("w") == payload(10_000, 5)
    with pytest.raises(KeyNotFound):
        store.commit("w")
    store.reserve("x", 5000)
    store.abort("x")
    assert not store.contains("x") and store.stats()["tiers"]["dram"]["used"] == 3 * 4096
    with pytest.raises(KeyNotFound):
        store.commit("x")


def test_keys(make_store):
    store = make_store()
    for k in ("a", "b", "c", "e"):
        store.put(k, k.encode())
    assert sorted(store.keys()) == [("a", 1, "dram"), ("b", 1, "dram"), ("c", 1, "dram"), ("e", 1, "dram")]


def test_bad_input_is_typed(make_store):
    store = make_store()
    with pytest.raises(ObjectTooLarge):
        store.put("big", bytes(2 << 20))
    with pytest.raises(ObjectTooLarge):
        store.reserve("big", 2 << 20)
    for bad in ("str", 3, None, b""):
        with pytest.raises(InvalidArgument):
            store.put("k", bad)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InvalidArgument):
            store.reserve("k", bad)
    with pytest.raises(InvalidArgument):
        store.put(42, b"v")
    with pytest.raises(KeyNotFound):
        store.get_into("nope", bytearray(10))
    assert store.get("nope") is None and store.size_of("nope") is None and store.remove("nope") is False
    store.put("k", b"0123456789")
    with pytest.raises(InvalidArgument):
        store.get_into("k", bytearray(3))
    with pytest.raises(InvalidArgument):
        store.get_into("k", b"read-only buffer")
    assert store.stats()["total"]["pinned"] == 0  # failed reads leave no pin behind
    # a pin validates its key only when it finds none (nothing invalid is stored): a bad key is
    # still told as such, not as a miss; a well-formed absent one (scoped too) is a miss
    for bad in ("", 42, None, ["k"], "a\x00b\x00c", "x" * 513, "-bad tenant\x00k"):
        with pytest.raises(InvalidArgument):
            store.pin(bad)
    for absent in ("nope", "bench\x00nope"):
        with pytest.raises(KeyNotFound):
            store.pin(absent)
    store.put("bench\x00k", b"scoped")
    with store.pinned("bench\x00k") as loc:
        assert bytes(store.arena.buffer[loc.offset:loc.offset + loc.length]) == b"scoped"
    assert store.stats()["total"]["pinned"] == 0
    with pytest.raises(InvalidArgument):
        TieredStore(1 << 20, policy="random")
    with pytest.raises(InvalidArgument):
        TieredStore(1 << 20, ssd_path="/tmp/x", ssd_capacity=0)


def test_restart_keeps_ssd_objects(tmp_path):
    path = str(tmp_path / "ssd")
    with TieredStore(1 << 20, ssd_path=path, ssd_capacity=4 << 20) as store:
        for i in range(8):
            store.put(f"k{i}", payload(OBJ, i))
        on_ssd = [k for k, _, t in store.keys() if t == "ssd"]
    assert on_ssd
    with TieredStore(1 << 20, ssd_path=path, ssd_capacity=4 << 20) as store:
        assert sorted(k for k, _, _ in store.keys()) == sorted(on_ssd)
        for k in on_ssd:
            assert store.get(k) == payload(OBJ, int(k[1:]))


def test_close_unlinks_the_arena():
    store = TieredStore(1 << 20)
    path = store.arena.path
    assert os.path.exists(path)
    store.close()
    assert not os.path.exists(path)


def test_another_process_reads_a_pinned_object(make_store):
    store = make_store()
    store.put("k", payload(OBJ, 3))
    with store.pinned("k") as loc:
        code = (
            "import sys, xxhash\n"
            "from kvpool.shm.arena import SharedArena\n"
            "a = SharedArena.attach(sys.argv[1])\n"
            "o, n = int(sys.argv[2]), int(sys.argv[3])\n"
            "print(xxhash.xxh3_64_hexdigest(a.buffer[o:o+n]))\n"
            "a.close()\n"
        )
        out = subprocess.run([sys.executable, "-c", code, store.arena.path, str(loc.offset), str(loc.length)],
                             capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    import xxhash

    assert out == xxhash.xxh3_64_hexdigest(payload(OBJ, 3))
    assert os.path.exists(store.arena.path)  # an attacher never unlinks


def test_from_settings(tmp_path):
    from kvpool.config import load_settings

    settings = load_settings(dram_capacity="2MiB", ssd_path=str(tmp_path / "s"), ssd_capacity="4MiB", eviction="lru")
    with TieredStore.from_settings(settings) as store:
        stats = store.stats()
        assert stats["policy"] == "lru"
        assert stats["tiers"]["dram"]["capacity"] == 2 << 20 and stats["tiers"]["ssd"]["capacity"] == 4 << 20


def test_close_with_a_live_export_does_not_raise():
    import numpy as np

    store = TieredStore(1 << 20)
    held = np.frombuffer(store.arena.buffer, dtype=np.uint8)  # e.g. a tensor over the arena
    path = store.arena.path
    store.close()
    assert not os.path.exists(path) and held.size == store.arena.size
