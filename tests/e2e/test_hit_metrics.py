"""Hit counters by source, read from a real prefill worker's /metrics: one prompt (four 256-token
chunks and a 76-token tail) is computed, then served from the worker's own prefix cache, then from
the pool's DRAM tier, then from its SSD tier; each step moves the counters by exactly its tokens.

The pool is the deployed shape (`DeployedShape`: a master and an LRU store node), so where a
chunk lives is known before each request (the master's key_info, after the node's heartbeat).
"""

from __future__ import annotations

import json
import os
import random
import time

import pytest

import kvpool
from e2e_support import scrape
from kvpool.keys import chunk_keys_hex
from reference_worker.client import WorkerClient

pytestmark = [pytest.mark.model, pytest.mark.timeout(900)]

SOURCES = ("worker", "pool_dram", "pool_ssd", "computed")


def counters(url: str) -> dict[str, float]:
    """This worker's hit counters summed over tenants: "tokens/<source>", "objects/<source>",
    "lookup_tokens", "lookup_objects", "lookups"."""
    out: dict[str, float] = {}
    names = {"kvpool_cache_hit_tokens_total": "tokens", "kvpool_cache_hit_objects_total": "objects",
             "kvpool_lookup_tokens_total": "lookup_tokens", "kvpool_lookup_objects_total": "lookup_objects",
             "kvpool_lookup_requests_total": "lookups"}
    for (name, labels), value in scrape(f"{url}/metrics").items():
        if name in names:
            source = dict(labels).get("source")
            key = f"{names[name]}/{source}" if source else names[name]
            out[key] = out.get(key, 0.0) + value
    return out


def moved(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    return {k: int(after.get(k, 0) - before.get(k, 0)) for k in sorted(set(before) | set(after))}


def expect(tokens: dict[str, int], objects: dict[str, int]) -> dict[str, int]:
    want = {f"tokens/{s}": tokens.get(s, 0) for s in SOURCES}
    want |= {f"objects/{s}": objects.get(s, 0) for s in SOURCES}
    return want | {"lookup_tokens": sum(tokens.values()), "lookup_objects": sum(objects.values()), "lookups": 1}


@pytest.fixture(scope="module")
def prefill(deployed):
    with WorkerClient(deployed.cluster.url("prefill")) as client:
        yield client


@pytest.fixture(scope="module")
def pool(deployed):
    client = kvpool.connect(deployed.master_address)
    yield client
    client.close()


def tiers_of(pool, keys: list[str]) -> list[str]:
    return [pool.admin("key_info", key=k)["replicas"][0]["tier"] for k in keys]


def settle(pool, keys: list[str], tier: str, timeout: float = 5.0) -> bool:
    """The master reports every key in `tier` (it learns of moves by the node's heartbeat)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if tiers_of(pool, keys) == [tier] * len(keys):
            return True
        time.sleep(0.1)
    return False


def test_counters_count_each_source_in_tokens_and_chunks(prefill, pool):
    info = prefill.info()
    c = info.chunk_tokens
    assert c == 256
    ids = [random.Random(2828).randrange(100, 40000) for _ in range(4 * c + 76)]
    keys = chunk_keys_hex(bytes.fromhex(info.namespace), ids, c)
    assert len(keys) == 4
    url = prefill.url

    def step(prompt: list[int]):
        before = counters(url)
        head = prefill.prefill(prompt)
        return head, moved(before, counters(url))

    # 1. Nothing cached anywhere: every token computed, every chunk computed.
    head, got = step(ids)
    assert head.computed_tokens == len(ids)
    assert got == expect({"computed": len(ids)}, {"computed": 4})

    # 2. The same prompt again: its four chunks come from the worker's own cache.
    head, got = step(ids)
    assert got == expect({"worker": 4 * c, "computed": 76}, {"worker": 4})

    # 3. A prompt of exactly those four chunks: fully cached, its last token recomputed (counted once).
    head, got = step(ids[:4 * c])
    assert got == expect({"worker": 4 * c - 1, "computed": 1}, {"worker": 4})

    # 4. No local copy: the chunks come from the pool's DRAM tier.
    assert settle(pool, keys, "dram"), tiers_of(pool, keys)
    prefill.clear_cache()
    head, got = step(ids)
    assert (head.pool_cached_tokens, head.pool_ssd_tokens, head.computed_tokens) == (4 * c, 0, 76)
    assert got == expect({"pool_dram": 4 * c, "computed": 76}, {"pool_dram": 4})

    # 5. Other objects push the chunks down to SSD: the next prefill reads them from there.
    filler = bytes(12 << 20)
    for i in range(40):
        pool.put(f"hit-metrics-filler/{os.getpid()}/{i}", filler)
        if settle(pool, keys, "ssd", timeout=0.5):
            break
    assert tiers_of(pool, keys) == ["ssd"] * 4
    prefill.clear_cache()
    head, got = step(ids)
    assert (head.pool_cached_tokens, head.pool_ssd_tokens, head.computed_tokens) == (4 * c, 4 * c, 76)
    assert got == expect({"pool_ssd": 4 * c, "computed": 76}, {"pool_ssd": 4})


def kvpool_cli(*args: str) -> str:
    import subprocess

    from kvpool.tools.launch.processes import KVPOOL

    done = subprocess.run([*KVPOOL, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_admin_stats_shows_hit_rates_by_source_and_tier(deployed, prefill):
    ids = [random.Random(2929).randrange(100, 40000) for _ in range(300)]
    prefill.prefill(ids)
    prefill.prefill(ids)  # its chunk from the worker's cache
    prefill.clear_cache()
    prefill.prefill(ids)  # and from the pool
    router = deployed.cluster.router_url
    doc = json.loads(kvpool_cli("admin", "--json", "stats", "--router", router))

    # The router's sums are the workers' own counters, exactly.
    want: dict[str, float] = {}
    for url in (deployed.cluster.url("prefill"), deployed.cluster.url("decode")):
        for k, v in counters(url).items():
            want[k] = want.get(k, 0) + v
    assert doc["prompt"]["tokens"] == {s: int(want[f"tokens/{s}"]) for s in SOURCES}
    assert doc["prompt"]["objects"] == {s: int(want[f"objects/{s}"]) for s in SOURCES}
    assert doc["prompt"]["lookup_tokens"] == int(want["lookup_tokens"]) > 0
    assert doc["prompt"]["hit_ratio"] == pytest.approx(1 - want["tokens/computed"] / want["lookup_tokens"])
    assert doc["prompt"]["tokens"]["worker"] >= 256
    assert all(s["ok"] for s in doc["sources"]), doc["sources"]
    dram = doc["pool_tiers"]["dram"]
    assert dram["hits"] > 0 and dram["hit_rate"] == pytest.approx(dram["hits"] / (dram["hits"] + dram["misses"]))

    table = kvpool_cli("admin", "stats", "--router", router)
    assert "prompt tokens by source" in table and "pool_ssd" in table and "hit ratio" in table
    # The master's view: each tier's hit rate next to its counters.
    master = kvpool_cli("admin", "--url", deployed.master_admin, "stats")
    assert "hit rate" in master and "%" in master
