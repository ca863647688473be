"""Fixtures for the pool tests: an embedded pool in this process, and its clients."""

from __future__ import annotations

import pytest

import kvpool
from kvpool.config import load_settings
from kvpool.embedded import EmbeddedPool


@pytest.fixture
def pool_settings():
    return load_settings(port=0, admin_port=0, dram_capacity="64MiB", heartbeat_s=0.2)


@pytest.fixture
def pool(pool_settings):
    p = EmbeddedPool(pool_settings).start()
    yield p
    p.stop()


@pytest.fixture(params=["shm", "shm-pin", "tcp", "engine"])
def client(request, pool, monkeypatch):
    """shm: same-host reads through the node's shm index (no round trip), else pinned through
    the node's RPC; shm-pin: the same without the index; tcp: the node-RPC data path; engine:
    bytes through the transfer engine over tcp."""
    if request.param == "shm-pin":
        monkeypatch.setenv("KVPOOL_SHM_INDEX", "0")  # this client does not map the index
    if request.param == "engine":
        c = kvpool.connect(pool.address, use_shm=False, data_path="engine", transports=("tcp",))
        assert c.data_paths() == {pool.address: "engine"}
    else:
        c = kvpool.connect(pool.address, use_shm=request.param.startswith("shm"), data_path="rpc")
    assert c.embedded
    yield c
    c.close()
