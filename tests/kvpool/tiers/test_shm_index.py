"""The DRAM index in shared memory (`kvpool.shm.index`): what is published is exactly what
is stored, and an optimistic reader in another process never accepts bytes of another object."""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import struct
import time

import pytest

from kvpool.errors import InvalidArgument
from kvpool.tiers import TieredStore
from kvpool.shm.index import ShmIndex, ShmIndexReader, auto_slots, index_path, supported

pytestmark = pytest.mark.skipif(not supported(), reason="the shm index is used on x86-64 only")


def _read(reader: ShmIndexReader, arena, key: str) -> bytes | None:
    """What a same-host client does: find, copy, validate."""
    hit = reader.find(key)
    if hit is None:
        return None
    slot, seq, offset, n = hit
    if offset + n > len(arena):
        return None
    data = bytes(arena[offset:offset + n])
    return data if reader.still(slot, seq) else None


def _map(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        return memoryview(mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ))
    finally:
        os.close(fd)


def test_publish_find_unpublish(tmp_path):
    index = ShmIndex(str(tmp_path / "idx"), 64)
    reader = ShmIndexReader(index.path)
    try:
        assert index.publish("a", 4096, 100)
        assert index.publish("b", 8192, 7)
        slot, seq, offset, n = reader.find("a")
        assert (offset, n) == (4096, 100) and seq % 2 == 0
        assert reader.find("b")[2:] == (8192, 7)
        assert reader.find("c") is None
        index.unpublish("a")
        assert reader.find("a") is None
        assert not reader.still(slot, seq)  # a reader that copied meanwhile rejects its copy
        assert reader.find("b")[2:] == (8192, 7)
        index.unpublish("never")  # a no-op
        assert index.publish("a", 12288, 5)  # the freed slot is reused
        assert reader.find("a")[2:] == (12288, 5)
        assert len(index) == 2
    finally:
        reader.close()
        index.close()
    assert not os.path.exists(index.path)


def test_full_probe_window_leaves_keys_unpublished_never_wrong(tmp_path):
    index = ShmIndex(str(tmp_path / "idx"), 4, probe=2)  # room for at most 5 slots' worth
    reader = ShmIndexReader(index.path)
    try:
        published = {f"k{i}": index.publish(f"k{i}", i * 4096, i + 1) for i in range(40)}
        assert index.unpublished == sum(not ok for ok in published.values()) > 0
        for key, ok in published.items():
            hit = reader.find(key)
            i = int(key[1:])
            assert (hit is not None) == ok
            if ok:
                assert hit[2:] == (i * 4096, i + 1)
    finally:
        reader.close()
        index.close()


def test_reader_refuses_a_file_that_is_not_an_index(tmp_path):
    bogus = tmp_path / "bogus"
    bogus.write_bytes(b"\0" * 4096)
    with pytest.raises(InvalidArgument):
        ShmIndexReader(str(bogus))
    with pytest.raises(InvalidArgument):
        ShmIndex(str(tmp_path / "x"), 100)  # not a power of two


def test_auto_slots_is_a_bounded_power_of_two():
    for cap in (1 << 20, 1 << 30, 3 << 30, 1 << 40):
        n = auto_slots(cap)
        assert n & (n - 1) == 0 and 4096 <= n <= 1 << 22


def test_store_publishes_what_dram_holds(make_store):
    store: TieredStore = make_store(dram=1 << 20, ssd=8 << 20)
    index = store.dram.index
    assert index is not None and index.path == index_path(store.arena.path)
    reader = ShmIndexReader(index.path)
    arena = _map(store.arena.path)
    try:
        values = {f"k{i}": os.urandom(200_000) for i in range(12)}  # five fit in DRAM
        for key, value in values.items():
            store.put(key, value)
        tiers = {k: t for k, _, t in store.keys()}
        for key, value in values.items():
            got = _read(reader, arena, key)
            if tiers[key] == "dram":
                assert got == value
            else:  # demoted: unpublished before its space was reused
                assert got is None
        assert len(index) == sum(1 for t in tiers.values() if t == "dram")
        dram_key = next(k for k, t in tiers.items() if t == "dram")
        with store.pinned(dram_key):
            assert store.remove(dram_key)
            assert _read(reader, arena, dram_key) is None  # gone for readers at once, freed at unpin
        store.hide("k11")
        assert _read(reader, arena, "k11") is None and store.contains("k11")
    finally:
        reader.close()
        arena.release()


def test_index_can_be_turned_off(make_store, monkeypatch):
    from kvpool.config import load_settings

    assert make_store(index_slots=0).dram.index is None
    stores = []
    try:
        stores.append(TieredStore.from_settings(load_settings(dram_capacity="1MiB")))
        assert stores[-1].dram.index is not None
        monkeypatch.setenv("KVPOOL_SHM_INDEX", "0")  # [rpc] shm_index: false
        stores.append(TieredStore.from_settings(load_settings(dram_capacity="1MiB")))
        assert stores[-1].dram.index is None
    finally:
        for store in stores:
            store.close()


# ---- a writer churning in another process while this one reads optimistically ----------------

KEYS = 48


def _value(i: int, version: int, size: int) -> bytes:
    return struct.pack("<II", i, version) * (size // 8)


def _churn(q, bye, seconds: float) -> None:
    import random

    rng = random.Random(7)
    store = TieredStore(1 << 20, policy="lru")  # ~12 objects of 4-160 KiB: constant eviction and reuse
    q.put((store.arena.path, store.dram.index.path))
    version = 0
    end = time.monotonic() + seconds
    ops = 0
    while time.monotonic() < end:
        i = rng.randrange(KEYS)
        key = f"key{i}"
        if store.contains(key) and rng.random() < 0.5:
            store.remove(key)
        else:
            version += 1
            store.put(key, _value(i, version, rng.randrange(1, 20) * 8192))
        ops += 1
    q.put(ops)
    bye.wait(60)  # keep the files until the reader is done
    store.close()


def test_optimistic_reads_never_return_other_bytes_under_churn():
    ctx = mp.get_context("spawn")
    q, bye = ctx.Queue(), ctx.Event()
    writer = ctx.Process(target=_churn, args=(q, bye, 3.0), daemon=True)
    writer.start()
    try:
        arena_path, idx_path = q.get(timeout=60)
        reader = ShmIndexReader(idx_path)
        arena = _map(arena_path)
        hits = reads = 0
        done = None
        while done is None:
            for i in range(KEYS):
                reads += 1
                got = _read(reader, arena, f"key{i}")
                if got is None:
                    continue
                hits += 1
                head = got[:8]
                assert struct.unpack("<II", head)[0] == i, "bytes of another key"
                assert got == head * (len(got) // 8), "torn or mixed bytes accepted"
            if not q.empty():
                done = q.get()
        assert done > 1000 and hits > 100, (done, hits, reads)
        bye.set()
        writer.join(timeout=30)
        assert writer.exitcode == 0
        reader.close()
        arena.release()
    finally:
        if writer.is_alive():
            writer.kill()
