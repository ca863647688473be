"""Schemathesis against the admin API's OpenAPI spec (issue 14): generated requests, valid and
invalid, to every operation of a real `MasterService`'s admin app (in-process ASGI, one node
record and three keys), with and without the bearer token. Checks: no 5xx, and every response
whose status the spec documents matches its schema. `KVPOOL_FUZZ_HTTP_EXAMPLES` (default 25)
examples per operation; the `slow` variant runs 500.

The router's and a worker's specs are run the same way (the router without workers: its 503 "no
worker has registered" is expected); their request bodies are parsed by hand (the specs declare
none), so those JSON bodies are fuzzed with hypothesis in test_http_bodies.py.
"""

from __future__ import annotations

import os

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed (pip install -e '.[dev]')")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
)

from fuzz_support import TRIED  # noqa: E402
from kvpool.admin import create_app  # noqa: E402
from kvpool.config import Settings  # noqa: E402
from kvpool.master.service import MasterService  # noqa: E402
from kvpool.messages import NodeInfo, Placed  # noqa: E402

HTTP_EXAMPLES = int(os.environ.get("KVPOOL_FUZZ_HTTP_EXAMPLES", "25"))
TOKEN = "fuzz-token-0a1b"
CHECKS = [not_a_server_error, response_schema_conformance, content_type_conformance]


@pytest.fixture(scope="module")
def master():
    svc = MasterService(Settings(heartbeat_s=100.0)).start()
    svc.register_node(NodeInfo(node_id="node-a", address="127.0.0.1:9", hostname="localhost", segments=["seg-a"],
                               shm_path=None, capacity={"dram": 64 << 20}))
    for i, size in enumerate((1000, 2000, 3000)):
        plan = svc.put_start(f"key-{i}", size)
        svc.put_end(f"key-{i}", plan.put_id, [Placed("node-a", "dram", "seg-a", i * 4096)])
    yield svc
    svc.stop()


def _operations(schema):
    return [result.ok() for result in schema.get_all_operations()]


def _both_modes(op):
    """Valid cases and invalid ones (wrong types, missing or extra fields), where the operation
    has anything to get wrong."""
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    strategies = [op.as_strategy(generation_mode=GenerationMode.POSITIVE)]
    try:
        strategies.append(op.as_strategy(generation_mode=GenerationMode.NEGATIVE))
    except Exception:  # nothing to make invalid (no parameters, no body)
        pass
    return st.one_of(*strategies)


def run_schema(schema, name: str, examples: int, headers_for=lambda case: {}, checks=CHECKS) -> int:
    """Every operation of `schema`, `examples` generated cases each (schemathesis' own pytest
    plugin does not run under pytest 9, so hypothesis drives its strategies here)."""
    from hypothesis import given

    operations = _operations(schema)
    assert operations, f"{name}: the OpenAPI spec lists no operation"
    for op in operations:
        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=_both_modes(op))
        def one(case):
            TRIED[f"http.{name} {op.label}"] += 1
            case.call_and_validate(headers=headers_for(case), checks=checks)

        one()
    return len(operations)


def _token_or_not(case) -> dict:
    """Three cases in four carry the token; the rest must be refused (401), never a 5xx."""
    return {"Authorization": f"Bearer {TOKEN}"} if hash(repr(case)) % 4 else {}


def test_admin_api(master):
    schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(master.admin, Settings(admin_token=TOKEN)))
    assert run_schema(schema, "admin", HTTP_EXAMPLES, _token_or_not) >= 10


@pytest.mark.slow
def test_admin_api_long(master):
    schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(master.admin, Settings(admin_token=TOKEN)))
    run_schema(schema, "admin (long)", 500, _token_or_not)


def _no_5xx_but_no_worker(ctx, response, case):
    """not_a_server_error, except the router's documented 503 while no worker has registered."""
    if response.status_code >= 500 and not (response.status_code == 503 and "worker" in response.text):
        raise AssertionError(f"{response.status_code} {response.text[:300]}")


def test_router_api():
    from kvpool.router.app import create_app as router_app
    from kvpool.router.service import Router, RouterConfig

    schema = schemathesis.openapi.from_asgi("/openapi.json", router_app(Router(RouterConfig())))
    checks = [_no_5xx_but_no_worker, response_schema_conformance, content_type_conformance]
    assert run_schema(schema, "router", HTTP_EXAMPLES, checks=checks) >= 8


@pytest.mark.model
def test_worker_api(worker_http):
    schema = schemathesis.openapi.from_asgi("/openapi.json", worker_http.app)
    checks = [not_a_server_error, response_schema_conformance, content_type_conformance]
    assert run_schema(schema, "worker", HTTP_EXAMPLES, checks=checks) >= 8
