"""Tenant isolation on a real `kvpool serve` with a keyring (issue 13): tenant A can neither read,
detect, list nor delete tenant B's objects, and a hit and a miss of another tenant's key take
the same path (asserted on the node's and master's counters, not on wall time)."""

from __future__ import annotations

import os

import pytest

import kvpool
from kvpool import messages as m
from kvpool.errors import KeyNotFound
from kvpool.rpc import RpcClient
from pool_auth_support import cred, write_keyring
from served_support import Serve

KEY = "0123456789abcdef0123456789abcdef"  # a chunk key both tenants could compute


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pool-tenants")
    served = Serve(tmp / "serve.log", write_keyring(tmp / "keyring.toml"), None, "--dram-capacity", "32MiB")
    try:
        yield served
    finally:
        served.stop()


def test_a_tenant_cannot_read_detect_list_or_delete_another_tenants_key(pool):
    secret = os.urandom(50_000)
    with kvpool.connect(pool.address, credential=cred("beta")) as beta, \
            kvpool.connect(pool.address, credential=cred("acme")) as acme:
        beta.put(KEY, secret)
        beta.put("beta/only", b"b" * 10)
        assert acme.scope == "acme\x00" and beta.scope == "beta\x00"
        # read
        assert acme.get(KEY) is None
        assert acme.get_batch([KEY, "beta/only"]) == [None, None]
        with pytest.raises(KeyNotFound):
            acme.get_into(KEY, bytearray(60_000))
        # detect
        assert acme.exists(KEY) is False
        assert acme.exists_batch([KEY]) == [False]
        assert acme.match_prefix([KEY, "beta/only"]) == 0
        with pytest.raises(KeyNotFound):
            acme.admin("key_info", key=KEY)
        # list: a tenant sees its own keys only, as it named them
        acme.put("acme/mine", b"a" * 10)
        assert acme.admin("keys") == ["acme/mine"]
        assert sorted(beta.admin("keys")) == sorted([KEY, "beta/only"])
        assert acme.admin("key_info", key="acme/mine")["key"] == "acme/mine"
        # delete
        assert acme.remove(KEY) is False
        assert acme.remove_batch([KEY, "beta/only"]) == [False, False]
        # the same key name is a separate object per tenant: acme's put does not touch beta's
        acme.put(KEY, b"acme's bytes")
        assert acme.get(KEY) == b"acme's bytes"
        assert beta.get(KEY) == secret
        assert beta.get("beta/only") == b"b" * 10
        # an admin sees every tenant's keys as stored
        with kvpool.connect(pool.address, credential=cred("ops")) as ops:
            keys = set(ops.admin("keys"))
            assert {"beta\x00" + KEY, "acme\x00" + KEY, "acme\x00acme/mine", "beta\x00beta/only"} <= keys
        assert acme.remove(KEY) is True and beta.get(KEY) == secret


def test_raw_messages_cannot_escape_the_scope(pool):
    with kvpool.connect(pool.address, credential=cred("beta")) as beta:
        beta.put("escape/target", b"t" * 100)
    rpc = RpcClient(pool.address, credential=cred("acme"))
    try:
        for name in ("beta\x00escape/target", "\x00escape/target"):  # naming the stored form: refused
            with pytest.raises(Exception, match="NUL"):
                rpc.call(m.Exists([name]))
        assert rpc.call(m.NodeGet(["escape/target"])).sizes == [-1]
        assert rpc.call(m.Lookup(["escape/target"])).entries == [None]  # and no lease on it
        pins = rpc.call(m.NodePin(["escape/target"], inline=False))
        assert pins.sizes == [-1] and pins.pin_id == 0
    finally:
        rpc.close()


def test_a_tenants_keys_are_scoped_in_place_and_keep_their_tenant():
    """The dispatch's scoping (`kvpool.security.authz`): a single key is rewritten in the decoded
    request's own list, several into a new one, each validated; the stored key's tenant is the
    principal's whatever the user key holds (a NUL in it is refused, never a second scope)."""
    from kvpool.errors import InvalidArgument
    from kvpool.security.authz import RULES
    from kvpool.security.tenancy import tenant_of

    scope = RULES[m.NodeGet][1]
    one = m.NodeGet(["acme/k"])
    keys = one.keys
    scope(one, "acme\x00")
    assert one.keys is keys and keys == ["acme\x00acme/k"] and tenant_of(keys[0]) == "acme"
    many = m.Exists(["k", "beta\x00"[:-1] + "/k"])
    scope(many, "acme\x00")
    assert many.keys == ["acme\x00k", "acme\x00beta/k"] and {tenant_of(k) for k in many.keys} == {"acme"}
    for bad in ("beta\x00k", "\x00k", "", "k" * 513):
        for msg in (m.NodeGet([bad]), m.Exists(["k", bad])):
            with pytest.raises(InvalidArgument):
                scope(msg, "acme\x00")
    unicode = m.NodeGet(["clé"])  # not ASCII: the slow check, which takes it
    scope(unicode, "acme\x00")
    assert unicode.keys == ["acme\x00clé"] and tenant_of(unicode.keys[0]) == "acme"


def _counters(pool) -> tuple[dict, dict]:
    rpc = RpcClient(pool.address, credential=cred("node"))
    try:
        store = rpc.call(m.NodeStats()).doc["total"]
        master = rpc.call(m.Admin("stats", {})).doc["result"]["counters"]
        return store, master
    finally:
        rpc.close()


@pytest.mark.parametrize("use_shm", [True, False])
def test_another_tenants_hit_and_a_true_miss_take_the_same_path(pool, use_shm):
    """Timing: acme asking for beta's key must not do anything a plain miss does not. Asserted
    on code path: each is one miss in the node's store stats and the master's counters, no hit,
    and the same data path answered."""
    with kvpool.connect(pool.address, credential=cred("beta")) as beta:
        beta.put("timing/hit", os.urandom(100_000))
    with kvpool.connect(pool.address, credential=cred("acme"), use_shm=use_shm) as acme:
        acme.get("warm-up")  # connections and mappings made
        deltas = []
        for key in ("timing/hit", "timing/nobody-has-this"):
            s0, m0 = _counters(pool)
            assert acme.get(key) is None
            s1, m1 = _counters(pool)
            deltas.append({"store_hits": s1["hits"] - s0["hits"], "store_misses": s1["misses"] - s0["misses"],
                           "master_hits": m1.get("hits", 0) - m0.get("hits", 0),
                           "master_misses": m1.get("misses", 0) - m0.get("misses", 0)})
        assert deltas[0] == deltas[1], deltas
        assert deltas[0]["store_hits"] == 0 and deltas[0]["master_hits"] == 0
        assert deltas[0]["store_misses"] + deltas[0]["master_misses"] >= 1
        assert set(acme.data_paths().values()) == ({"shm"} if use_shm else {"rpc"})


def test_shm_fast_path_serves_a_tenant_its_own_scoped_keys(pool):
    """Same host: the tenant client looks up its scoped keys in the node's shm index itself."""
    value = os.urandom(200_000)
    with kvpool.connect(pool.address, credential=cred("acme")) as acme:
        acme.put("shm/own", value)
        conn = next(iter(acme._nodes.values()))
        if conn.index is None:
            pytest.skip("no shm index here")
        assert acme.get("shm/own") == value
        assert "shm/own" in conn.touched  # served from the index, reported as the tenant named it
        acme.flush()
        with kvpool.connect(pool.address, credential=cred("beta")) as beta:
            assert beta.get("shm/own") is None  # beta's scoped lookup finds nothing
            assert not any("shm/own" in k for nc in beta._nodes.values() for k in nc.touched)


@pytest.fixture(scope="module")
def quota_pool(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pool-quotas")
    keyring = write_keyring(tmp / "keyring.toml", {"acme": {"quota_bytes": "1MiB", "quota_keys": 40},
                                                   "beta": {"quota_keys": 3}})
    served = Serve(tmp / "serve.log", keyring, None, "--dram-capacity", "32MiB")
    try:
        yield served
    finally:
        served.stop()


def test_quotas_answer_quota_exceeded_and_count_per_tenant(quota_pool):
    from kvpool.errors import QuotaExceeded

    with kvpool.connect(quota_pool.address, credential=cred("acme")) as acme, \
            kvpool.connect(quota_pool.address, credential=cred("beta")) as beta:
        for i in range(3):
            acme.put(f"q/{i}", b"x" * (300 << 10))
        with pytest.raises(QuotaExceeded, match="quota_bytes"):
            acme.put("q/3", b"x" * (300 << 10))  # 1.2 MiB > 1 MiB
        assert acme.get("q/3") is None
        assert acme.put_batch([("q/small", b"s" * 1000)]) == [None]  # what still fits is taken
        for i in range(3):
            beta.put(f"k/{i}", b"y")
        with pytest.raises(QuotaExceeded, match="quota_keys"):
            beta.put("k/3", b"y")
        assert beta.remove("k/0")  # freeing a key frees its quota
        beta.put("k/3", b"y")
        # another tenant's quota is not this one's: an unquota'd principal is unaffected
        with kvpool.connect(quota_pool.address, credential=cred("ops")) as ops:
            ops.put("big", b"z" * (2 << 20))
            assert ops.get("big") == b"z" * (2 << 20)
        acme.remove("q/0")
        acme.put("q/3", b"x" * (300 << 10))


def test_a_tenants_flood_does_not_flush_another_tenants_working_set(pool):
    """beta's hot working set (4 MiB) survives acme writing (and re-reading) 48 MiB through a
    32 MiB pool: eviction takes acme's own objects first."""
    chunk = 256 << 10
    with kvpool.connect(pool.address, credential=cred("beta")) as beta, \
            kvpool.connect(pool.address, credential=cred("acme")) as acme:
        hot = {f"hot/{i}": os.urandom(chunk) for i in range(16)}
        assert beta.put_batch(list(hot.items())) == [None] * 16
        for _ in range(2):
            assert beta.get_batch(list(hot)) == list(hot.values())
        filler = os.urandom(chunk)
        for i in range(192):  # acme's flood is hot too: each object read twice right away
            acme.put(f"flood/{i}", filler)
            acme.get(f"flood/{i}")
            acme.get(f"flood/{i}")
        assert beta.get_batch(list(hot)) == list(hot.values())
        assert sum(v is not None for v in acme.get_batch([f"flood/{i}" for i in range(192)])) < 192  # it did evict
        for i in range(192):
            acme.remove(f"flood/{i}")


def test_node_stats_tell_a_tenant_how_to_reach_the_node_not_the_pools_traffic(pool):
    tenant = RpcClient(pool.address, credential=cred("acme"))
    node = RpcClient(pool.address, credential=cred("node"))
    try:
        mine, full = tenant.call(m.NodeStats()).doc, node.call(m.NodeStats()).doc
    finally:
        tenant.close()
        node.close()
    assert mine["shm_path"] == full["shm_path"] and mine["arena_size"] == full["arena_size"]
    assert "total" in full and "total" not in mine and "tiers" not in mine  # no hit/miss counters
