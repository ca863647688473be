"""Fixtures for the worker tests: in-process workers on the real model and pool, their HTTP app
in-process (FastAPI TestClient: real status codes, no process), and whole worker processes.

`worker_factory` is the same as the one in test_service.py (which keeps its own copy); the
others are used by the router-contract tests (sampling, tokenizer, load, drain, registration).
Helpers that tests import live in `serving_support.py` (a module name no other test folder uses).
"""

from __future__ import annotations

import pytest


@pytest.fixture
def worker_factory(reference_model, pool):
    from reference_worker.service import Worker, WorkerConfig

    made = []

    def make(start: bool = True, **kw):
        w = Worker(WorkerConfig(**kw), reference_model, pool)
        if start:
            w.start(warmup=False)
        made.append(w)
        return w

    yield make
    for w in made:
        w.stop()


@pytest.fixture
def http_of():
    """`http_of(worker)`: a TestClient of that worker's FastAPI app (the app's real status codes)."""
    from fastapi.testclient import TestClient

    from reference_worker.app import create_app

    clients = []

    def make(worker):
        client = TestClient(create_app(worker), raise_server_exceptions=False)
        clients.append(client)
        return client

    yield make
    for c in clients:
        c.close()


@pytest.fixture
def spawn_worker(embedded_pool, tmp_path):
    """`spawn_worker(role, *args)`: a `kvpool worker` process on the test's pool, healthy when
    returned (a `launcher.Proc`: `.url`, `.popen`, `.log_tail()`). Stopped at teardown if alive."""
    from kvpool.tools.launch.local import LocalCluster, PoolSpec, WorkerSpec

    clusters = []

    def spawn(role: str, *args: str):
        name = f"{role}-{len(clusters)}"
        cluster = LocalCluster(tmp_path / name, [WorkerSpec(role, name, ["--threads", "1", *args])],
                               PoolSpec(address=embedded_pool.address), env={"KVPOOL_LOG_LEVEL": "INFO"},
                               timeout_s=240)
        clusters.append(cluster)
        cluster.start(sequential=True)
        return cluster.workers[name]

    yield spawn
    for cluster in clusters:
        cluster.stop()
