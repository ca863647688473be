"""End to end: `kvpool serve` in its own process with its admin API; an SDK client writes real
objects; the REST API and `kvpool admin` see them; bad input over the SDK and over REST gets a
typed error or a 4xx, and the pool keeps serving after each."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import kvpool
from etcd_testing import serve_process
from kvpool.errors import InvalidArgument, KeyNotFound, ObjectTooLarge
from kvpool.tools.launch.processes import clean_env

TOKEN = "e2e-token"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(pool address, admin url) of a `kvpool serve` process with a 32 MiB DRAM tier."""
    with serve_process(tmp_path_factory.mktemp("serve") / "serve.log", "32MiB",
                       env={"KVPOOL_ADMIN_TOKEN": TOKEN}) as served:
        yield served


@pytest.fixture
def client(served):
    c = kvpool.connect(served[0])
    yield c
    c.close()


@pytest.fixture
def http(served):
    with httpx.Client(base_url=served[1], timeout=10, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        yield c


def _still_serving(client, http):
    client.put("alive/probe", b"x" * 100)
    assert client.get("alive/probe") == b"x" * 100
    assert http.get("/health").status_code == 200
    assert http.get("/v1/stats").status_code == 200


def test_rest_sees_what_the_sdk_wrote(client, http):
    client.put("e2e/one", b"a" * 5000)
    client.put("tail/req-42", b"b" * 300)
    assert http.get("/ready").status_code == 200
    nodes = http.get("/v1/nodes").json()["nodes"]
    assert len(nodes) == 1 and nodes[0]["state"] == "up"
    info = http.get("/v1/keys/e2e/one").json()["info"]
    assert info["size"] == 5000 and info["state"] == "complete"
    assert [r["node_id"] for r in info["replicas"]] == [nodes[0]["node_id"]]
    assert http.get("/v1/keys/tail/req-42").json()["info"]["size"] == 300
    stats = http.get("/v1/stats").json()["stats"]
    assert stats["objects"] >= 2 and stats["tiers"]["dram"]["capacity_bytes"] == 32 << 20
    assert "kvpool_pool_objects" in http.get("/metrics").text


def test_evict_through_rest_makes_a_miss(client, http):
    client.put("e2e/evict-me", b"z" * 1000)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = http.post("/v1/evict", json={"keys": ["e2e/evict-me"]}, headers=auth)
    assert r.status_code == 200 and r.json()["result"]["evicted"] == 1
    assert client.get("e2e/evict-me") is None
    assert http.get("/v1/keys/e2e/evict-me").status_code == 404


def test_cli_against_the_pool(served, client):
    client.put("e2e/cli", b"c" * 777)
    env = clean_env(KVPOOL_ADMIN_TOKEN=TOKEN)
    kv = str(Path(sys.executable).with_name("kvpool"))
    r = subprocess.run([kv, "admin", "--url", served[1], "--json", "key", "e2e/cli"], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert '"size": 777' in r.stdout
    r = subprocess.run([kv, "admin", "--url", served[1], "stats"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0 and "dram" in r.stdout


# ---- bad input: one test each, and the pool keeps serving ------------------------------------

def test_sdk_oversized_value(client, http):
    with pytest.raises(ObjectTooLarge):
        client.put("e2e/huge", bytes(64 << 20))  # twice the node's DRAM tier
    assert client.get("e2e/huge") is None
    _still_serving(client, http)


def test_sdk_malformed_key(client, http):
    for bad in ("", "k" * 513, "nul\x00key", 42):
        with pytest.raises(InvalidArgument):
            client.put(bad, b"v")
        with pytest.raises(InvalidArgument):
            client.get(bad)
    _still_serving(client, http)


def test_sdk_unknown_key(client, http):
    assert client.get("e2e/never-written") is None
    with pytest.raises(KeyNotFound):
        client.get_into("e2e/never-written", bytearray(16))
    assert not client.exists("e2e/never-written")
    _still_serving(client, http)


def test_rest_unknown_key(client, http):
    r = http.get("/v1/keys/e2e/never-written")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    _still_serving(client, http)


def test_rest_malformed_key(client, http):
    r = http.get("/v1/keys/" + "k" * 600)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_argument"
    _still_serving(client, http)


def test_rest_malformed_json(client, http):
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    for path, method in (("/v1/evict", "POST"), ("/v1/config", "PATCH")):
        r = http.request(method, path, content=b'{"keys": [', headers=auth)
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    _still_serving(client, http)


def test_rest_wrong_or_missing_token(client, http):
    client.put("e2e/guarded", b"g" * 10)
    with httpx.Client(base_url=http.base_url, timeout=10) as bare:
        for headers in ({}, {"Authorization": "Bearer not-the-token"}):
            r = bare.post("/v1/evict", json={"keys": ["e2e/guarded"]}, headers=headers)
            assert r.status_code == 401 and set(r.json()) == {"version", "error"}
            r = bare.get("/v1/keys/e2e/guarded", headers=headers)
            assert r.status_code == 401 and set(r.json()) == {"version", "error"}
    assert client.get("e2e/guarded") == b"g" * 10  # nothing was evicted
    _still_serving(client, http)


def test_rest_unknown_node(client, http):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert http.get("/v1/nodes/no-such-node").status_code == 404
    assert http.post("/v1/nodes/no-such-node/drain", headers=auth).status_code == 404
    assert http.delete("/v1/nodes/no-such-node", headers=auth).status_code == 404
    _still_serving(client, http)


def test_sdk_unknown_node(client, http):
    with pytest.raises(KeyNotFound):
        client.admin("node", node_id="no-such-node")
    _still_serving(client, http)


def test_stats_per_tier_counters(client, http):
    import time

    client.put("e2e/tiered", b"t" * 4096)
    assert client.get("e2e/tiered") == b"t" * 4096
    assert client.get("e2e/absent-for-stats") is None
    deadline = time.monotonic() + 10  # node counters arrive with its next heartbeat
    while True:
        dram = http.get("/v1/stats").json()["stats"]["tiers"]["dram"]
        if dram.get("bytes_in", 0) >= 4096 and dram.get("hits", 0) >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for field in ("capacity_bytes", "used_bytes", "hits", "misses", "evictions", "bytes_in", "bytes_out"):
        assert field in dram, field
    assert dram["bytes_in"] >= 4096 and dram["hits"] >= 1
    metrics = http.get("/metrics").text
    assert 'kvpool_tier_hits_total{tier="dram"}' in metrics


def test_admin_client_with_awkward_keys(served, client):
    from kvpool.admin.client import AdminClient

    keys = ["e2e/ü ñ", "e2e/q?x=1#frag", "e2e/100%", "tail/req/with/slashes", "/leading-slash"]
    for i, key in enumerate(keys):
        client.put(key, bytes([i]) * (100 + i))
    with AdminClient(served[1], TOKEN) as admin:
        for i, key in enumerate(keys):
            assert admin.key(key)["size"] == 100 + i, key
        assert admin.evict(keys=[keys[0]])["evicted"] == 1
        with pytest.raises(KeyNotFound):
            admin.key(keys[0])
