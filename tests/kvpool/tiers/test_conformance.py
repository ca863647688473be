"""The one conformance suite every tier runs (the contract is in kvpool/tiers/base.py)."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.errors import CapacityError, InvalidArgument, KeyNotFound, ObjectTooLarge
from kvpool.tiers import DramTier, SsdTier, Tier

CAPACITY = 1 << 20


def _make(kind: str, tmp_path):
    if kind == "dram":
        return DramTier(CAPACITY)
    if kind == "ssd":
        return SsdTier(str(tmp_path / "lmdb"), CAPACITY)
    raise ValueError(kind)


@pytest.fixture(params=["dram", "ssd"])
def tier(request, tmp_path):
    t = _make(request.param, tmp_path)
    yield t
    t.close()


def _payload(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_is_a_tier(tier):
    assert isinstance(tier, Tier)
    assert tier.used == 0 and tier.capacity >= CAPACITY - 4096


@pytest.mark.parametrize("size", [1, 4095, 4096, 4097, 65536, 300_000])
def test_roundtrip(tier, size):
    data = _payload(size, size)
    tier.put("k", data)
    assert tier.contains("k") and tier.size_of("k") == size
    assert tier.get("k") == data
    out = bytearray(size + 10)
    assert tier.get_into("k", out) == size
    assert bytes(out[:size]) == data
    assert ("k", size) in list(tier.keys())
    assert tier.used >= size


def test_accepts_bytes_like_values(tier):
    arr = np.arange(1000, dtype=np.float32)
    tier.put("np", arr)
    tier.put("mv", memoryview(b"abc"))
    tier.put("ba", bytearray(b"xyz"))
    assert tier.get("np") == arr.tobytes()
    assert tier.get("mv") == b"abc" and tier.get("ba") == b"xyz"
    out = np.zeros(1000, dtype=np.float32)
    tier.get_into("np", out)
    assert np.array_equal(out, arr)


def test_first_writer_wins(tier):
    tier.put("k", b"first")
    tier.put("k", b"second!")
    assert tier.get("k") == b"first"


def test_remove_frees_space(tier):
    tier.put("a", _payload(100_000, 1))
    assert tier.remove("a") is True
    assert tier.remove("a") is False
    assert not tier.contains("a") and tier.get("a") is None and tier.size_of("a") is None
    assert tier.used == 0
    with pytest.raises(KeyNotFound):
        tier.get_into("a", bytearray(100_000))


def test_fills_up_with_capacity_error(tier):
    n = 0
    with pytest.raises(CapacityError):
        for n in range(100):
            tier.put(f"k{n}", _payload(200_000, n))
    assert tier.used <= tier.capacity
    assert 3 <= n < 100
    for i in range(n):  # nothing stored before the failure was damaged
        assert tier.get(f"k{i}") == _payload(200_000, i)


@pytest.mark.parametrize("bad", ["text", 42, None, b"", object()])
def test_bad_values(tier, bad):
    with pytest.raises(InvalidArgument):
        tier.put("k", bad)
    assert not tier.contains("k")


# NUL only ever separates a tenant's scope from a user key ("<tenant>\x00<key>", kvpool.contract)
@pytest.mark.parametrize("bad", ["", 7, b"bytes", "x" * 600, "\x00b", "a\x00\x00b"])
def test_bad_keys(tier, bad):
    with pytest.raises(InvalidArgument):
        tier.put(bad, b"v")


def test_oversized(tier):
    with pytest.raises(ObjectTooLarge):
        tier.put("big", bytes(2 * CAPACITY))
    assert tier.used == 0


def test_small_or_readonly_buffer(tier):
    tier.put("k", b"0123456789")
    with pytest.raises(InvalidArgument):
        tier.get_into("k", bytearray(5))
    with pytest.raises(InvalidArgument):
        tier.get_into("k", b"x" * 20)
    assert tier.get("k") == b"0123456789"


def test_long_unicode_key(tier):
    key = "é" * 256  # 512 UTF-8 bytes: the longest key allowed
    tier.put(key, b"v")
    assert tier.get(key) == b"v"
    assert [k for k, _ in tier.keys()] == [key]


def test_ssd_path_has_one_owner(tmp_path):
    first = SsdTier(str(tmp_path / "lmdb"), CAPACITY)
    with pytest.raises(InvalidArgument):
        SsdTier(str(tmp_path / "lmdb"), CAPACITY)
    first.close()
    first.close()  # idempotent
    SsdTier(str(tmp_path / "lmdb"), CAPACITY).close()
