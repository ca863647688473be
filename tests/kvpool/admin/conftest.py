"""Fixtures: a real `MasterService` with one registered node record and its admin app served
over HTTP on a free loopback port (no store process: these tests are about the API layer; the
end-to-end ones in test_pool_admin.py use a real embedded pool)."""

from __future__ import annotations

import httpx
import pytest

from kvpool.admin import create_app, serve_in_thread
from kvpool.config import Settings
from kvpool.master.service import MasterService
from kvpool.messages import NodeInfo, Placed

TOKEN = "test-token-7f3a"
NODE = "node-a"


@pytest.fixture
def master():
    # a long heartbeat so the node record is not dropped for silence during a test
    svc = MasterService(Settings(heartbeat_s=100.0)).start()
    svc.register_node(NodeInfo(node_id=NODE, address="127.0.0.1:9", hostname="localhost", segments=["seg-a"],
                               shm_path=None, capacity={"dram": 64 << 20}))
    for i, size in enumerate((1000, 2000, 3000)):
        plan = svc.put_start(f"key-{i}", size)
        svc.put_end(f"key-{i}", plan.put_id, [Placed(NODE, "dram", "seg-a", i * 4096)])
    yield svc
    svc.stop()


def _serve(master, settings):
    handle = serve_in_thread(create_app(master.admin, settings), "127.0.0.1", 0)
    return handle


@pytest.fixture
def admin(master):
    """(handle, client) of an app WITH a bearer token configured; the client presents it."""
    handle = _serve(master, Settings(admin_token=TOKEN))
    with httpx.Client(base_url=handle.url, timeout=10, headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        yield handle, client
    handle.stop()


@pytest.fixture
def open_admin(master, monkeypatch):
    """(handle, client) of an app with NO token configured and authentication off (no keyring,
    not even the user's own: `KVPOOL_LOCAL_AUTH=off`)."""
    monkeypatch.setenv("KVPOOL_LOCAL_AUTH", "off")
    handle = _serve(master, Settings())
    with httpx.Client(base_url=handle.url, timeout=10) as client:
        yield handle, client
    handle.stop()


@pytest.fixture
def auth():
    return {"Authorization": f"Bearer {TOKEN}"}
