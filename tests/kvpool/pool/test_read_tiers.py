"""Which tier served a read (`Client.get_batch(keys, tiers=...)`): what hit counters by tier
(`kvpool_cache_hit_tokens_total{source="pool_dram"|"pool_ssd"}`) are built on. Every data path:
the shm index (no round trip), a pin over the node's RPC, `NodeGet` over TCP, the transfer engine.
"""

from __future__ import annotations

import pytest

import kvpool
from kvpool.config import load_settings
from kvpool.embedded import EmbeddedPool

MIB = 1 << 20


@pytest.fixture
def tiered_pool(tmp_path):
    settings = load_settings(port=0, admin_port=0, heartbeat_s=0.2, dram_capacity="8MiB",
                             ssd_path=str(tmp_path / "ssd"), ssd_capacity="64MiB", eviction="lru")
    p = EmbeddedPool(settings).start()
    yield p
    p.stop()


@pytest.fixture(params=["shm", "shm-pin", "tcp", "engine"])
def client(request, tiered_pool, monkeypatch):
    if request.param == "shm-pin":
        monkeypatch.setenv("KVPOOL_SHM_INDEX", "0")  # this client does not map the index
    if request.param == "engine":
        c = kvpool.connect(tiered_pool.address, use_shm=False, data_path="engine", transports=("tcp",))
    else:
        c = kvpool.connect(tiered_pool.address, use_shm=request.param.startswith("shm"), data_path="rpc")
    yield c
    c.close()


def tier_in_store(pool: EmbeddedPool, key: str) -> str:
    return {k: tier for k, _, tier in pool.node.store.keys()}[key]


def test_tiers_name_the_tier_that_served_each_read(tiered_pool, client):
    client.put("hot", bytes([1]) * MIB)
    tiers: list[str] = []
    values = client.get_batch(["hot", "absent"], tiers=tiers)
    assert values[0] == bytes([1]) * MIB and values[1] is None
    assert tiers == ["dram", ""]
    client.flush()  # unpin it (a pin rides on the next request otherwise): a pinned object stays in DRAM

    # Fill the 8 MiB DRAM tier: "hot" is demoted to SSD.
    for i in range(12):
        client.put(f"filler/{i}", bytes([2]) * MIB)
    assert tier_in_store(tiered_pool, "hot") == "ssd"
    values = client.get_batch(["hot", "filler/11"], tiers=tiers)
    assert values == [bytes([1]) * MIB, bytes([2]) * MIB]
    assert tiers == ["ssd", "dram"]

    # That read promoted it: the next one is a DRAM hit.
    assert tier_in_store(tiered_pool, "hot") == "dram"
    client.get_batch(["hot"], tiers=tiers)
    assert tiers == ["dram"]


def test_tiers_of_a_malformed_key_is_a_miss(tiered_pool, client):
    client.put("k", b"x" * 100)
    tiers = ["stale"]
    assert client.get_batch(["", "k"], tiers=tiers) == [None, b"x" * 100]
    assert tiers == ["", "dram"]
