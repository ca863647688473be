"""A real etcd on free loopback ports (per test), from `etcd_testing` (tests/kvpool)."""

from __future__ import annotations

import pytest

from etcd_testing import EtcdServer, etcd_binary


@pytest.fixture
def etcd(tmp_path):
    if etcd_binary() is None:
        pytest.skip("etcd is not installed (make system-deps)")
    with EtcdServer(tmp_path) as server:
        yield server
