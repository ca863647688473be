"""Same-host reads through the node's shm index: no round trip, and never stale or foreign data.

The embedded pool and the client share this host, so the client maps the node's arena and its
DRAM index; the tests count the client's requests to prove a hit costs none, and check that
whatever makes an object unreadable (remove, eviction by the master, demotion) takes it out of
the index before the call that did it returns."""

from __future__ import annotations

import os

import pytest

import kvpool
from kvpool.shm.index import supported

pytestmark = pytest.mark.skipif(not supported(), reason="the shm index is used on x86-64 only")


class Counted:
    """Counts requests a client sends to its node (round trips and one-way messages)."""

    def __init__(self, rpc):
        self.rpc, self.requests, self.oneway = rpc, 0, 0
        rpc.send_request = self._wrap(rpc.send_request, "requests")  # `call` sends through it
        rpc.send_oneway = self._wrap(rpc.send_oneway, "oneway")

    def _wrap(self, fn, counter):
        def counted(*a, **kw):
            setattr(self, counter, getattr(self, counter) + 1)
            return fn(*a, **kw)
        return counted


@pytest.fixture
def reader(pool):
    c = kvpool.connect(pool.address)
    assert c._nodes[pool.address].index is not None
    yield c
    c.close()


def test_a_hit_costs_no_round_trip(pool, reader):
    values = {f"k{i}": os.urandom(n) for i, n in enumerate((1, 4096, 65536, 1 << 20))}
    for key, value in values.items():
        reader.put(key, value)
    counted = Counted(reader._nodes[pool.address].rpc)
    for key, value in values.items():
        assert reader.get(key) == value
        buf = bytearray(len(value) + 10)
        assert reader.get_into(key, buf) == len(value) and bytes(buf[:len(value)]) == value
    assert reader.get_batch(list(values)) == list(values.values())
    assert counted.requests == 0
    assert reader.get("absent") is None  # a miss asks the node, the authority
    assert counted.requests == 1


def test_reads_are_reported_as_hits(pool, reader):
    reader.put("h", b"x" * 100_000)
    before = pool.node.store.stats()["tiers"]["dram"]["hits"]
    master_before = pool.master.state.counters["hits"]
    for _ in range(5):
        assert reader.get("h") is not None
    reader.flush()
    after = lambda: pool.node.store.stats()["tiers"]["dram"]["hits"]  # noqa: E731
    import time
    deadline = time.monotonic() + 5
    while after() < before + 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert after() == before + 5
    assert pool.master.state.counters["hits"] == master_before + 5


def test_remove_and_reput_are_seen_at_once(pool, reader):
    other = kvpool.connect(pool.address, use_shm=False)
    try:
        reader.put("r", b"a" * 70_000)
        assert reader.get("r") == b"a" * 70_000
        assert other.remove("r") is True
        assert reader.get("r") is None  # hidden before remove returned, though the bytes go later
        other.put("r", b"b" * 50_000)
        assert reader.get("r") == b"b" * 50_000
        reader.put("e", b"c" * 70_000)
        assert pool.master.admin.evict(keys=["e"])["evicted"] == 1
        assert reader.get("e") is None
    finally:
        other.close()


def test_a_too_small_buffer_is_refused_without_copying(pool, reader):
    from kvpool.errors import InvalidArgument

    reader.put("big", b"z" * 100_000)
    buf = bytearray(10)
    with pytest.raises(InvalidArgument):
        reader.get_into("big", buf)
    assert buf == bytearray(10)
