"""Tenant quotas hold across the pool, not per node (issue 13), on real processes: a master and two
store nodes, standalone (`kvpool node --master`) and in cluster mode (a real etcd). A tenant with
a quota of 1 MiB cannot hold more than 1 MiB whichever nodes its objects land on (each node's own
check alone would let it hold 1 MiB on each), every replica counts, pending puts count, and
removes, evictions and a lost node give the room back; another tenant is unaffected. The
tenant's own use and quota are what its view of the REST admin API shows."""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

import kvpool
from kvpool import messages as m
from kvpool.security.keyring import admin_api_token
from kvpool.errors import QuotaExceeded, Unavailable
from kvpool.rpc import RpcClient
from pool_auth_support import SECRETS, clean_env, cred, write_keyring

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kvpool"))
from etcd_testing import EtcdServer, etcd_binary, free_port, spawn, wait_for as poll  # noqa: E402

QUOTA = 1 << 20
OBJ = 128 << 10  # eight of them fill acme's quota
ADMIN_TOKEN = "t" * 40


def wait_for(pred, timeout=20.0):
    return poll(pred, timeout, step=0.1, retry_on=(kvpool.KVPoolError,))


@pytest.fixture(scope="module", params=["standalone", "etcd"])
def pool(request, tmp_path_factory):
    """A master with its admin API and two nodes (n0, n1) of 16 MiB, all with the keyring."""
    if request.param == "etcd" and etcd_binary() is None:
        pytest.skip("etcd is not installed (make system-deps)")
    tmp = tmp_path_factory.mktemp(f"quotas-{request.param}")
    keyring = write_keyring(tmp / "keyring.toml", {"acme": {"quota_bytes": "1MiB", "quota_keys": 40},
                                                   "beta": {"quota_keys": 30}})
    token_file = tmp / "admin.token"
    token_file.write_text(ADMIN_TOKEN)
    os.chmod(token_file, 0o600)
    env = clean_env(KVPOOL_AUTH_FILE=str(keyring), KVPOOL_ADMIN_TOKEN_FILE=str(token_file))
    admin_port = free_port()
    common = ["--port", "0", "--heartbeat-s", "0.3"]
    procs: list = []
    etcd = EtcdServer(tmp).start() if request.param == "etcd" else None
    try:
        if etcd is not None:
            common += ["--meta", etcd.meta]
            with ThreadPoolExecutor(3) as ex:
                started = [ex.submit(spawn, ["master", *common, "--admin-port", str(admin_port)], env=env)]
                started += [ex.submit(spawn, ["node", *common, "--node-id", f"n{i}", "--dram-capacity", "16MiB",
                                               "--admin-port", "0"], env=env) for i in range(2)]
                procs += [f.result() for f in started]
        else:
            procs.append(spawn(["master", *common, "--admin-port", str(admin_port)], env=env))
            procs += [spawn(["node", *common, "--master", procs[0].address, "--node-id", f"n{i}",
                             "--dram-capacity", "16MiB", "--admin-port", "0"], env=env) for i in range(2)]
        ops = kvpool.connect(procs[0].address, credential=cred("ops"), timeout=15)
        assert wait_for(lambda: len(ops.admin("nodes")) == 2)
        yield SimpleNamespace(address=procs[0].address, admin=f"http://127.0.0.1:{admin_port}", ops=ops,
                              nodes=procs[1:], mode=request.param)
        ops.close()
    finally:
        for p in procs:
            p.stop()
        if etcd is not None:
            etcd.stop()
        for p in procs:
            assert not any("Traceback" in line for line in p.output), "".join(p.output[-50:])


def usage(pool, tenant: str) -> dict:
    """The tenant's own view of the REST admin API: its use and quota."""
    token = admin_api_token(SECRETS[tenant].encode())
    r = httpx.get(f"{pool.admin}/v1/stats", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200, r.text
    return r.json()["stats"]


def objects_per_node(pool) -> dict[str, int]:
    return {n["node_id"]: n["objects"] for n in pool.ops.admin("nodes")}


def test_a_tenant_cannot_hold_more_than_its_quota_across_two_nodes(pool):
    value = os.urandom(OBJ)
    with kvpool.connect(pool.address, credential=cred("acme"), replicas=1) as acme, \
            kvpool.connect(pool.address, credential=cred("beta"), replicas=1) as beta:
        for i in range(8):
            acme.put(f"q/{i}", value)
        # spread over both nodes: each holds about half, so neither node's own check would refuse more
        assert all(n >= 2 for n in objects_per_node(pool).values()), objects_per_node(pool)
        assert usage(pool, "acme") == {"tenant": "acme", "bytes": QUOTA, "keys": 8, "quota_bytes": QUOTA,
                                       "quota_keys": 40}
        with pytest.raises(QuotaExceeded, match="quota_bytes"):
            acme.put("q/8", value)
        assert acme.get("q/8") is None and isinstance(acme.put_batch([("q/8", b"x")])[0], QuotaExceeded)
        # another tenant is unaffected: beta stores 2 MiB (no byte quota) and reads it back
        theirs = {f"b/{i}": os.urandom(OBJ) for i in range(16)}
        assert beta.put_batch(list(theirs.items())) == [None] * 16
        assert beta.get_batch(list(theirs)) == list(theirs.values())
        # removes give the room back
        assert acme.remove_batch(["q/0", "q/1"]) == [True, True]
        # every replica counts: a second replica of 128 KiB takes 128 KiB more of the quota
        acme.put("r/0", value, replicas=2)
        assert len(pool.ops.admin("key_info", key="acme\x00r/0")["replicas"]) == 2
        assert usage(pool, "acme")["bytes"] == QUOTA
        with pytest.raises(QuotaExceeded, match="quota_bytes"):
            acme.put("r/1", b"small", replicas=1)
        assert acme.remove("r/0")
        # an admin's eviction gives it back too (the REST admin API names the key as stored)
        r = httpx.post(f"{pool.admin}/v1/evict", json={"keys": ["acme\x00q/2"]},
                       headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        assert r.status_code == 200 and r.json()["result"]["evicted"] == 1, r.text
        assert usage(pool, "acme") == {"tenant": "acme", "bytes": 5 * OBJ, "keys": 5, "quota_bytes": QUOTA,
                                       "quota_keys": 40}
        for i in (0, 1, 2):
            acme.put(f"q/{i}", value)
        assert acme.get("q/8") is None and usage(pool, "acme")["bytes"] == QUOTA
        assert acme.remove_batch([f"q/{i}" for i in range(8)]) == [True] * 8
        assert beta.remove_batch(list(theirs)) == [True] * 16
    assert usage(pool, "acme")["bytes"] == 0 and usage(pool, "beta")["keys"] == 0


def test_the_key_quota_is_pool_wide_and_per_tenant(pool):
    with kvpool.connect(pool.address, credential=cred("beta"), replicas=1) as beta, \
            kvpool.connect(pool.address, credential=cred("acme"), replicas=1) as acme:
        assert beta.put_batch([(f"k/{i}", b"y") for i in range(30)]) == [None] * 30
        assert all(n >= 10 for n in objects_per_node(pool).values())
        with pytest.raises(QuotaExceeded, match="quota_keys"):
            beta.put("k/30", b"y")
        acme.put("mine", b"a")  # acme's keys are acme's
        assert beta.remove("k/0")
        beta.put("k/30", b"y")
        assert beta.remove_batch([f"k/{i}" for i in range(1, 31)]) == [True] * 30
        assert acme.remove("mine")


def test_a_pending_put_holds_its_room_until_it_ends(pool):
    rpc = RpcClient(pool.address, credential=cred("acme"))
    try:
        plan = rpc.call(m.PutStart(["pending"], [QUOTA - OBJ], replicas=1)).plans[0]
        assert isinstance(plan, m.PutPlan) and plan.put_id, plan
        assert usage(pool, "acme")["bytes"] == QUOTA - OBJ
        with kvpool.connect(pool.address, credential=cred("acme"), replicas=1) as acme:
            acme.put("fits", os.urandom(OBJ))
            with pytest.raises(QuotaExceeded):
                acme.put("does-not", b"z")
            err = rpc.call(m.PutEnd(["pending"], [plan.put_id], [[]])).errors[0]  # abort: nothing written
            assert err is not None and err.code == Unavailable.code
            acme.put("does-not", b"z")
            assert acme.remove_batch(["fits", "does-not"]) == [True, True]
    finally:
        rpc.close()
    assert usage(pool, "acme")["bytes"] == 0


def test_a_lost_node_gives_its_replicas_room_back(pool):
    """Last in this module: it kills a node."""
    value = os.urandom(OBJ)
    with kvpool.connect(pool.address, credential=cred("acme"), replicas=1, timeout=15) as acme:
        for i in range(8):
            acme.put(f"lost/{i}", value)
        with pytest.raises(QuotaExceeded):
            acme.put("lost/8", value)
        on_n1 = [k for k in (f"lost/{i}" for i in range(8))
                 if pool.ops.admin("key_info", key="acme\x00" + k)["replicas"][0]["node_id"] == "n1"]
        assert on_n1
        pool.nodes[1].kill()
        assert wait_for(lambda: usage(pool, "acme")["bytes"] == (8 - len(on_n1)) * OBJ, timeout=30), usage(pool, "acme")
        deadline = time.monotonic() + 10
        while True:  # the client may still try the dead node once
            try:
                acme.put("lost/8", value)
                break
            except Unavailable:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert acme.get("lost/8") == value
