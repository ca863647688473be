"""Property tests of the eviction policies: pinned keys are never evicted, tracking is exact,
S3-FIFO and ARC resist a scan that flushes LRU, and ARC keeps hand-offs waiting for their reader."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.errors import InvalidArgument
from kvpool.tiers.policy import ARCPolicy, LRUPolicy, S3FIFOPolicy, make_policy

KEYS = [f"k{i}" for i in range(12)]
op = st.tuples(st.sampled_from(["insert", "access", "remove", "evict", "pin", "unpin"]), st.sampled_from(KEYS))


@pytest.mark.parametrize("name", ["lru", "s3fifo", "arc"])
@settings(max_examples=150, deadline=None)
@given(program=st.lists(op, max_size=150))
def test_pinned_never_evicted_and_tracking_exact(name, program):
    policy = make_policy(name, 10 * 100)
    tracked: set[str] = set()
    pinned: set[str] = set()
    for action, key in program:
        if action == "insert" and key not in tracked:
            policy.insert(key, 100)
            tracked.add(key)
        elif action == "access":
            policy.access(key)
        elif action == "remove":
            policy.remove(key)
            tracked.discard(key)
        elif action == "pin":
            pinned.add(key)
        elif action == "unpin":
            pinned.discard(key)
        elif action == "evict":
            victim = policy.evict(lambda k: k not in pinned)
            if victim is None:
                assert tracked <= pinned, "a policy may give up only when everything is pinned"
            else:
                assert victim in tracked and victim not in pinned
                tracked.discard(victim)
        assert len(policy) == len(tracked)
        assert all(k in policy for k in tracked)


def test_lru_order():
    p = LRUPolicy()
    for k in "abc":
        p.insert(k, 1)
    p.access("a")
    assert [p.evict(lambda k: True) for _ in range(3)] == ["b", "c", "a"]
    assert p.evict(lambda k: True) is None


def _hits(policy, trace, cache_objects):
    cached: set[str] = set()
    hits = 0
    for key in trace:
        if key in cached:
            hits += 1
            policy.access(key)
            continue
        while len(cached) >= cache_objects:
            cached.discard(policy.evict(lambda k: True))
        policy.insert(key, 1)
        cached.add(key)
    return hits


@pytest.mark.parametrize("cls", [S3FIFOPolicy, ARCPolicy])
def test_scan_resistant(cls):
    """The hot set survives every scan. Each hot key is written (its first miss) and read twice per
    round: ARC counts reads, not the write (see ARCPolicy), so its second read is what makes it
    frequent."""
    hot = [f"hot{i}" for i in range(20)]
    trace: list[str] = []
    for round_ in range(30):
        trace += hot + hot + hot  # reused: worth keeping
        trace += [f"scan{round_}-{i}" for i in range(40)]  # one-hit wonders, as many as the cache holds
    lru = _hits(LRUPolicy(), trace, 40)
    ours = _hits(cls(40), trace, 40)
    assert lru == 30 * 20 * 2  # LRU loses the hot set to every scan
    assert ours == 20 * 2 + 29 * 20 * 3, (ours, lru)  # after the first round, every hot read hits


def test_unknown_policy():
    with pytest.raises(InvalidArgument):
        make_policy("mru", 100)


def test_s3fifo_takes_from_small_when_main_is_all_pinned():
    """Regression (found by the FairPolicy property test): small below its 10% share and every
    main key pinned used to spin the budget away and answer None with evictable keys in small."""
    p = S3FIFOPolicy(1000)
    p.insert("hot", 2)
    p.access("hot")
    p.insert("pinned", 2)
    p.insert("new", 2)
    assert p.evict(lambda k: k != "hot") == "pinned"  # hot had a hit: it goes to main
    p.insert("pinned", 2)
    p.insert("x", 2)
    assert p.evict(lambda k: k not in ("hot", "pinned")) in ("new", "x")


def _handoffs(policy, cache_objects: int, in_flight: int, n: int = 400, reuse: bool = False) -> tuple[int, int]:
    """Prefill-to-decode hand-offs: each step writes a new object and reads, once, the one written
    `in_flight` steps before (the decode worker pulling its KV); with `reuse`, every other step also
    reads one of three shared prefixes (re-written when lost). (hits, misses) of the hand-off reads."""
    cached: set[str] = set()
    hits = misses = 0

    def write(key: str) -> None:
        if key in cached:
            return
        while len(cached) >= cache_objects:
            cached.discard(policy.evict(lambda k: True))
        policy.insert(key, 1)
        cached.add(key)

    shared = [f"sys{j}" for j in range(3)]
    for i in range(n):
        write(f"h{i}")
        if reuse and i % 2 == 0:
            for key in shared:
                if key in cached:
                    policy.access(key)
                else:
                    write(key)
        if i >= in_flight:
            key = f"h{i - in_flight}"
            if key in cached:
                hits += 1
                policy.access(key)
            else:
                misses += 1
    return hits, misses


@pytest.mark.parametrize("reuse", [False, True])
def test_arc_keeps_handoffs_waiting_for_their_reader(reuse):
    """A write is not a reference: an object read once (a consumed hand-off) must not outrank one
    still waiting for its first read. Counting the write, ARC lost 388 of 396 hand-off reads here."""
    lru = _handoffs(LRUPolicy(), 12, 4, reuse=reuse)
    arc = _handoffs(ARCPolicy(12), 12, 4, reuse=reuse)
    assert lru[1] == 0
    assert arc == lru


@settings(max_examples=150, deadline=None)
@given(program=st.lists(op, max_size=150))
def test_arc_unread_keys_are_in_t1(program):
    policy = ARCPolicy(6)
    for action, key in program:
        if action == "insert":
            policy.insert(key, 1)
        elif action == "access":
            policy.access(key)
        elif action == "remove":
            policy.remove(key)
        elif action == "evict":
            policy.evict(lambda k: True)
        assert policy._unread <= set(policy._t1)
