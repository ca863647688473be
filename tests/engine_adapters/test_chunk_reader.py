"""The one chunk reader (`engine_adapters.chunk_reader`) on the real embedded pool: its three
forms and its one rule for a damaged chunk (a miss, removed, reported; a later put heals it).
Every adapter reads through it: the HF adapter (conformance suite), the reference workers
(serving/test_service.py), the vLLM connector and the SGLang backend (their own test files)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from engine_adapters.chunk_reader import ChunkReader
from kvpool.chunk_format import ChunkAuth, KVLayout, encode_chunk
from kvpool.errors import AlreadyExists, CorruptObject, KeyNotFound
from kvpool.keys import Namespace, chunk_keys_hex

LAYOUT = KVLayout(num_layers=3, kv_heads=2, head_dim=8, dtype="float32", chunk_tokens=16)
NS = Namespace("reader-test", "w" * 32, LAYOUT)
AUTH = ChunkAuth(NS.digest())  # unkeyed: the binding to namespace and key, no MAC (tests/security: keyed)


def _chunks(pool, n: int, tokens: int = 16):
    """n stored chunk objects under chained keys, with their payload arrays."""
    ids = list(range(1, n * 16 + 1))
    keys = chunk_keys_hex(NS.digest(), ids, 16)
    rng = np.random.default_rng(n)
    payloads = [rng.standard_normal(LAYOUT.shape(tokens)).astype(np.float32) for _ in keys]
    for key, kv in zip(keys, payloads):
        pool.put(key, encode_chunk(LAYOUT, kv, tokens, key=key, auth=AUTH))
    return keys, payloads


def _put(pool, key: str, blob) -> None:
    """A put right after a removal: the pool finishes a remove once read leases end ("retry later")."""
    for _ in range(200):
        try:
            return pool.put(key, blob)
        except AlreadyExists:
            time.sleep(0.01)
    raise AssertionError(f"could not put {key}")


def _reader(pool, removed: list[str], batch_chunks: int | None = None) -> ChunkReader:
    reader = ChunkReader(pool, LAYOUT, auth=AUTH, on_removed=removed.append)
    if batch_chunks:
        reader.batch_chunks = batch_chunks
    return reader


@pytest.mark.parametrize("batch_chunks", [1, 2, None])
def test_run_is_the_longest_intact_prefix_in_batches(pool, batch_chunks):
    keys, payloads = _chunks(pool, 4)
    removed: list[str] = []
    reader = _reader(pool, removed, batch_chunks)
    assert reader.match(keys + ["0" * 32]) == 4
    views = reader.run(keys)
    assert [np.array_equal(v.as_numpy(), p) for v, p in zip(views, payloads)] == [True] * 4
    pool.remove(keys[2])
    assert len(reader.run(keys)) == 2, "a miss ends the run"
    assert reader.fetched == 6 and reader.damaged == 0 and not removed


def test_damaged_chunk_is_a_miss_removed_reported_and_healed_by_a_later_put(pool, damage):
    keys, payloads = _chunks(pool, 3)
    removed: list[str] = []
    reader = _reader(pool, removed)
    damage(keys[1])
    assert len(reader.run(keys)) == 1
    assert removed == [keys[1]] and reader.damaged == 1
    assert not pool.exists(keys[1]), "removed: a put never overwrites, so a damaged copy would stay forever"
    _put(pool, keys[1], encode_chunk(LAYOUT, payloads[1], 16, key=keys[1], auth=AUTH))  # the next save of the same tokens
    views = reader.run(keys)
    assert len(views) == 3 and np.array_equal(views[1].as_numpy(), payloads[1])


def test_read_answers_per_key(pool, damage):
    keys, _ = _chunks(pool, 4)
    removed: list[str] = []
    reader = _reader(pool, removed, batch_chunks=3)
    pool.remove(keys[0])
    damage(keys[2])
    got = reader.read(keys)
    assert [v is not None for v in got] == [False, True, False, True]
    assert removed == [keys[2]] and not pool.exists(keys[2])


def test_a_wrong_token_count_or_layout_is_damage_too(pool):
    keys, payloads = _chunks(pool, 2)
    short = KVLayout(3, 2, 8, "float32", 16)
    pool.remove(keys[1])
    pool.flush()
    _put(pool, keys[1], encode_chunk(short, payloads[1][:, :, :, :5], 5, key=keys[1], auth=AUTH))  # tail-sized, chunk key
    removed: list[str] = []
    reader = _reader(pool, removed)
    assert len(reader.run(keys)) == 1 and removed == [keys[1]]
    other = KVLayout(3, 2, 8, "float16", 16)
    _put(pool, keys[1], encode_chunk(other, payloads[1].astype(np.float16), 16, key=keys[1], auth=AUTH))
    assert len(reader.run(keys)) == 1 and removed == [keys[1], keys[1]]


def test_exact_is_all_or_nothing(pool, damage):
    keys, payloads = _chunks(pool, 3)
    removed: list[str] = []
    reader = _reader(pool, removed)
    assert len(reader.exact(keys, [16, 16, 16])) == 3
    with pytest.raises(CorruptObject):
        reader.exact(keys, [16, 16, 5])
    assert removed == [keys[2]], "a wrong token count is damage: removed"
    with pytest.raises(KeyNotFound):
        reader.exact(keys, [16, 16, 16])
    _put(pool, keys[2], encode_chunk(LAYOUT, payloads[2], 16, key=keys[2], auth=AUTH))
    damage(keys[0])
    with pytest.raises(CorruptObject):
        reader.exact(keys, [16, 16, 16])
    assert not pool.exists(keys[0])


def test_a_chunk_that_does_not_name_us_is_a_miss_left_in_place(pool):
    """Unkeyed: a chunk under our key that names another key or namespace, or an unbound (or
    malformed) object, is rejected, not removed: only our own damaged chunks are removed."""
    keys, payloads = _chunks(pool, 3)
    removed: list[str] = []
    rejected: list[str] = []
    reader = ChunkReader(pool, LAYOUT, auth=AUTH, on_removed=removed.append, on_rejected=lambda k, e: rejected.append(k))
    copied = encode_chunk(LAYOUT, payloads[0], 16, key=keys[0], auth=AUTH)  # valid, but keys[0]'s
    pool.remove(keys[1])
    pool.flush()
    _put(pool, keys[1], copied)
    assert len(reader.run(keys)) == 1 and rejected == [keys[1]] and pool.exists(keys[1])
    other = ChunkAuth(Namespace("reader-test", "w" * 32, LAYOUT, tenant_salt="other").digest())
    assert reader.read(["x1"]) == [None]
    _put(pool, "x1", encode_chunk(LAYOUT, payloads[0], 16, key="x1", auth=other))
    _put(pool, "x2", encode_chunk(LAYOUT, payloads[0], 16))
    _put(pool, "x3", b"KVPC" + bytes(100))
    assert reader.read(["x1", "x2", "x3"]) == [None, None, None]
    assert rejected == [keys[1], "x1", "x2", "x3"] and not removed and reader.rejected == 4
    assert all(pool.exists_batch(["x1", "x2", "x3"]))
