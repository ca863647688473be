"""The worker's local prefix cache: bounded LRU of full chunks with stored/removed events."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference_worker.events import EventLog
from reference_worker.prefix_cache import LocalPrefixCache

CHUNK = (2, 2, 1, 4, 8)  # layers, K/V, heads, tokens, head_dim
NBYTES = 2 * 2 * 1 * 4 * 8 * 4


def chunk(value: float = 0.0) -> torch.Tensor:
    return torch.full(CHUNK, float(value), dtype=torch.float32)


def test_match_and_run_stop_at_the_first_gap():
    cache = LocalPrefixCache(10 * NBYTES)
    cache.put_many([("a", chunk(1)), ("b", chunk(2)), ("d", chunk(4))])
    assert cache.match(["a", "b", "c", "d"]) == 2
    run = cache.get_run(["a", "b", "c", "d"])
    assert [float(t[0, 0, 0, 0, 0]) for t in run] == [1.0, 2.0]
    assert cache.match(["x", "a"]) == 0
    assert cache.tokens == 12 and cache.nbytes == 3 * NBYTES


def test_lru_eviction_keeps_capacity_and_evicts_chain_ends_first():
    cache = LocalPrefixCache(3 * NBYTES)
    cache.put_many([("a", chunk()), ("b", chunk()), ("c", chunk())])
    cache.get_run(["a", "b", "c"])  # refreshed back to front: "c" is now the oldest of the chain
    cache.put_many([("x", chunk())])
    assert "c" not in cache and {"a", "b", "x"} <= {k for k in ("a", "b", "x") if k in cache}
    assert cache.nbytes <= cache.capacity_bytes
    assert cache.evictions == 1


def test_capacity_zero_disables_the_cache():
    cache = LocalPrefixCache(0)
    assert cache.put_many([("a", chunk())]) == 0
    assert cache.match(["a"]) == 0 and len(cache) == 0


def test_events_report_every_entry_and_exit():
    cache = LocalPrefixCache(2 * NBYTES)
    log = EventLog()
    cache.add_listener(lambda ev: log.append(ev.kind, ev.keys, "local"))
    cache.put_many([("a", chunk()), ("b", chunk())])
    cache.put_many([("c", chunk())])  # evicts "a"
    cache.remove(["b"])
    events = log.since(0).events
    assert [(e.kind, e.keys) for e in events] == [("stored", ["a", "b"]), ("removed", ["a"]), ("stored", ["c"]),
                                                  ("removed", ["b"])]
    assert [e.seq for e in events] == [1, 2, 3, 4]
    assert log.since(2).events[0].seq == 3 and log.since(4).events == []


def test_event_log_reports_dropped_history():
    log = EventLog(capacity=2)
    for i in range(5):
        log.append("stored", [str(i)], "local")
    resp = log.since(0)
    assert resp.dropped and [e.seq for e in resp.events] == [4, 5] and resp.next == 5
    assert not log.since(4).dropped


def test_a_failing_listener_does_not_break_the_cache():
    cache = LocalPrefixCache(2 * NBYTES)
    cache.add_listener(lambda ev: 1 / 0)
    assert cache.put_many([("a", chunk())]) == 1
    assert "a" in cache


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 5), st.lists(st.tuples(st.sampled_from(["put", "get", "remove", "clear"]),
                                             st.lists(st.sampled_from("abcdefgh"), max_size=4)), max_size=40))
def test_property_capacity_and_events_agree_with_contents(capacity_chunks, ops):
    cache = LocalPrefixCache(capacity_chunks * NBYTES)
    present: set[str] = set()

    def on_event(ev):
        if ev.kind == "stored":
            assert not present & set(ev.keys)
            present.update(ev.keys)
        else:
            assert set(ev.keys) <= present
            present.difference_update(ev.keys)

    cache.add_listener(on_event)
    for op, keys in ops:
        if op == "put":
            cache.put_many([(k, chunk()) for k in keys])
        elif op == "get":
            run = cache.get_run(keys)
            assert len(run) == cache.match(keys)
        elif op == "remove":
            cache.remove(keys)
        else:
            cache.clear()
        assert cache.nbytes <= cache.capacity_bytes
        assert present == {k for k in "abcdefgh" if k in cache}
        assert cache.nbytes == len(present) * NBYTES
