"""Fixtures for the pool tests: an embedded pool in this process, and its clients."""

from __future__ import annotations

import pytest

import kvpool
from kvpool.config import load_settings
from kvpool.server import EmbeddedPool


@pytest.fixture
def pool_settings():
    return load_settings(port=0, admin_port=0, dram_capacity="64MiB", heartbeat_s=0.2)


@pytest.fixture
def pool(pool_settings):
    p = EmbeddedPool(pool_settings).start()
    yield p
    p.stop()


@pytest.fixture(params=["shm", "tcp"])
def client(request, pool):
    c = kvpool.connect(pool.address, use_shm=request.param == "shm")
    assert c.embedded
    yield c
    c.close()
