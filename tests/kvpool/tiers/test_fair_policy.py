"""`FairPolicy` (eviction fair across tenants): the policy Protocol's invariants, and each
victim comes from the tenant holding the most bytes among those with an evictable key."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.tiers.policy import FairPolicy, make_policy
from kvpool.security.tenancy import tenant_of

KEYS = [f"{t}\x00k{i}" if t else f"k{i}" for t in ("", "a", "b") for i in range(6)]
op = st.tuples(st.sampled_from(["insert", "access", "remove", "evict", "pin", "unpin"]), st.sampled_from(KEYS),
               st.integers(1, 5))


@pytest.mark.parametrize("name", ["lru", "s3fifo", "arc"])
@settings(max_examples=150, deadline=None)
@given(program=st.lists(op, max_size=150))
def test_tracking_exact_pins_respected_and_victims_fair(name, program):
    policy = FairPolicy(lambda: make_policy(name, 1000))
    tracked: dict[str, int] = {}
    pinned: set[str] = set()
    for action, key, size in program:
        if action == "insert" and key not in tracked:
            policy.insert(key, size)
            tracked[key] = size
        elif action == "access":
            policy.access(key)
        elif action == "remove":
            policy.remove(key)
            tracked.pop(key, None)
        elif action == "pin":
            pinned.add(key)
        elif action == "unpin":
            pinned.discard(key)
        elif action == "evict":
            held: dict[str, int] = {}
            for k, n in tracked.items():
                held[tenant_of(k)] = held.get(tenant_of(k), 0) + n
            victim = policy.evict(lambda k: k not in pinned)
            if victim is None:
                assert set(tracked) <= pinned
            else:
                assert victim in tracked and victim not in pinned
                candidates = {tenant_of(k) for k in tracked if k not in pinned}
                assert held[tenant_of(victim)] == max(held[t] for t in candidates)
                del tracked[victim]
        assert len(policy) == len(tracked)
        assert all(k in policy for k in tracked)
        for tenant in ("", "a", "b"):
            assert policy.bytes_of(tenant) == sum(n for k, n in tracked.items() if tenant_of(k) == tenant)


def test_one_tenant_is_the_inner_policy():
    fair, plain = FairPolicy(lambda: make_policy("lru", 10)), make_policy("lru", 10)
    for p in (fair, plain):
        for k in "abcd":
            p.insert(k, 1)
        p.access("a")
    assert [fair.evict(lambda k: True) for _ in range(4)] == [plain.evict(lambda k: True) for _ in range(4)]


def test_scoped_keys_of_the_longest_kind_in_dram_ssd_and_after_a_restart(tmp_path):
    """A tenant's stored key is "<tenant>\\x00<user key>": with a 64-character tenant and a 512-byte
    user key it is longer than lmdb's 511-byte key limit; every tier and a restart take it."""
    from kvpool.tiers import TieredStore

    tenant = "t" * 64
    keys = [f"{tenant}\x00" + "k" * 511 + str(i) for i in range(4)]
    path = str(tmp_path / "ssd")
    with TieredStore(1 << 20, ssd_path=path, ssd_capacity=8 << 20) as store:
        for i, key in enumerate(keys):
            store.put(key, bytes([i]) * (400 << 10))  # 4 x 400 KiB through 1 MiB of DRAM: demotions
        assert store.stats()["tiers"]["ssd"]["objects"] >= 2
        assert store.usage(tenant) == (4 * (400 << 10), 4)
        for i, key in enumerate(keys):
            assert store.get(key) == bytes([i]) * (400 << 10)
    with TieredStore(1 << 20, ssd_path=path, ssd_capacity=8 << 20) as store:
        assert sum(store.get(k) is not None for k in keys) >= 2  # what was on SSD survived, still scoped
        assert store.usage(tenant)[1] >= 2 and store.usage("")[1] == 0


def test_a_keys_tenant_is_what_precedes_its_first_nul_derived_once():
    """Each key counts for `tenant_of(key)`, derived when it is inserted and kept for its
    accesses, removal and eviction: the part before the first NUL (a later NUL does not move
    it), and tenant "" for a key with no NUL or one that starts with NUL."""
    policy = FairPolicy(lambda: make_policy("lru", 1000))
    sizes = {"a\x00k": 1, "a\x00k\x00more": 2, "a\x00": 4, "\x00a\x00k": 8, "plain": 16, "ab\x00k": 32,
             "b\x00a\x00k": 64}
    for key, size in sizes.items():
        policy.insert(key, size)
    tenants = {"a": 7, "": 24, "ab": 32, "b": 64, "a\x00k": 0, "plain": 0}
    assert {t: policy.bytes_of(t) for t in tenants} == tenants
    policy.insert("a\x00k", 999)  # tracked already: its size and tenant stay (LRU: now after "a\x00")
    policy.access("a\x00k\x00more")  # and this one after both
    policy.access("untracked\x00k")  # neither tracked nor a tenant made for it
    assert policy.bytes_of("untracked") == 0 and "untracked\x00k" not in policy
    policy.remove("\x00a\x00k")
    assert policy.bytes_of("") == 16 and policy.bytes_of("a") == 7 and len(policy) == 6
    victims = [policy.evict(lambda k: True) for _ in range(7)]
    assert victims == ["b\x00a\x00k", "ab\x00k", "plain", "a\x00", "a\x00k", "a\x00k\x00more", None]
    assert all(policy.bytes_of(t) == 0 for t in tenants) and len(policy) == 0
