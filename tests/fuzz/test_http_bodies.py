"""Hypothesis fuzz of the JSON bodies of the router's and a worker's HTTP APIs (issue 14). Their
OpenAPI specs declare no request bodies (the handlers parse the bytes themselves, with msgspec or
pydantic), so schemathesis has nothing to generate from; these tests send arbitrary JSON, mutated
valid bodies and raw bytes instead. Property: never a 500, and every error is a JSON body.

The router runs without workers (its parsing and validation layer: a valid body then gets 503
"no worker has registered"); the worker is a real one on the reference model and an embedded pool
(`model` marker), with token counts bounded so each request stays cheap.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from fuzz_support import EXAMPLES, LONG_EXAMPLES, TRIED, fuzz_bytes, fuzz_settings

JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
                    max_leaves=10)


def _body_strategy(seeds: list[dict]):
    """Arbitrary JSON, a valid body with one field replaced by arbitrary JSON or removed, or raw
    bytes (mutated valid bodies included)."""
    def replace(seed, key, value, drop):
        body = dict(seed)
        if drop:
            body.pop(key, None)
        else:
            body[key] = value
        return json.dumps(body, allow_nan=True).encode()

    seed_st = st.sampled_from(seeds)
    return st.one_of(
        JSON.map(lambda v: json.dumps(v, allow_nan=True).encode()),
        seed_st.flatmap(lambda s: st.builds(replace, st.just(s), st.sampled_from(sorted(s)), JSON, st.booleans())),
        fuzz_bytes([json.dumps(s).encode() for s in seeds], max_size=256),
    )


def _check(resp, where: str) -> None:
    assert resp.status_code < 500 or resp.status_code == 503, f"{where}: {resp.status_code} {resp.text[:300]}"
    if resp.status_code >= 400:
        body = resp.json()  # errors are JSON, never a traceback page
        assert "error" in body or "detail" in body, f"{where}: {body}"


# ---- the router --------------------------------------------------------------------------------

ROUTER_SEEDS = {
    "/v1/chat/completions": [{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}],
    "/v1/completions": [{"model": "m", "prompt": "hi", "max_tokens": 4}, {"model": "m", "prompt": [1, 2, 3]}],
    "/admin/workers/drain": [{"url": "http://127.0.0.1:1"}],
}


@pytest.fixture(scope="module")
def router_http():
    from fastapi.testclient import TestClient

    from kvpool.router.app import create_app
    from kvpool.router.service import Router, RouterConfig

    with TestClient(create_app(Router(RouterConfig())), raise_server_exceptions=False) as client:
        yield client


def _fuzz_router(client, target: str, examples: int) -> None:
    for path, seeds in ROUTER_SEEDS.items():
        @fuzz_settings(examples)
        @given(_body_strategy(seeds))
        def one(body):
            TRIED[f"{target} POST {path}"] += 1
            resp = client.post(path, content=body, headers={"content-type": "application/json"})
            _check(resp, f"POST {path} {body[:200]!r}")
            if resp.status_code == 503:  # only for want of a worker
                assert "worker" in resp.text, resp.text

        one()

    @fuzz_settings(examples)
    @given(st.text(max_size=40), st.integers(-(2**40), 2**40))
    def route(prompt, max_tokens):
        TRIED[f"{target} GET /admin/route"] += 1
        _check(client.get("/admin/route", params={"prompt": prompt, "max_tokens": max_tokens}), "GET /admin/route")
        _check(client.delete("/admin/workers", params={"url": prompt}), "DELETE /admin/workers")

    route()


def test_router_bodies(router_http):
    _fuzz_router(router_http, "http.router", EXAMPLES // 3)


@pytest.mark.slow
def test_router_bodies_long(router_http):
    _fuzz_router(router_http, "http.router (long)", LONG_EXAMPLES // 10)


# ---- a worker ----------------------------------------------------------------------------------

WORKER_SEEDS = {
    "/v1/tokenize": [{"v": 1, "prompt": "hi"}, {"v": 1, "messages": [{"role": "user", "content": "hi"}]}],
    "/v1/prefill": [{"v": 1, "token_ids": [1, 2, 3], "sampling": {"temperature": 0.5, "top_p": 0.9, "seed": 1}}],
    "/v1/generate": [{"v": 1, "token_ids": [1, 2, 3], "max_tokens": 2}],
    "/v1/decode": [{"v": 1, "first_token": 5, "max_tokens": 2,
                    "handle": {"version": 1, "namespace": "0" * 32, "request_id": "r", "num_tokens": 3,
                               "chunk_tokens": 16, "chunk_keys": [], "tail_key": "tail/r"}}],
}


def _cheap(body: bytes) -> bool:
    """Keep each request to a few tokens of model work."""
    try:
        doc = json.loads(body)
    except ValueError:
        return True
    if not isinstance(doc, dict):
        return True
    ids, mt = doc.get("token_ids"), doc.get("max_tokens")
    return not (isinstance(ids, list) and len(ids) > 16) and not (isinstance(mt, int) and mt > 4)


def _fuzz_worker(http, target: str, examples: int) -> None:
    for path, seeds in WORKER_SEEDS.items():
        @fuzz_settings(examples)
        @given(_body_strategy(seeds))
        def one(body):
            assume(_cheap(body))
            TRIED[f"{target} POST {path}"] += 1
            resp = http.post(path, content=body, headers={"content-type": "application/json"})
            assert resp.status_code < 500, f"POST {path} {body[:200]!r}: {resp.status_code} {resp.text[:300]}"
            if resp.status_code >= 400:
                assert "code" in resp.json(), resp.text  # the worker's error body: {code, message}
            elif resp.headers.get("content-type", "").startswith("application/x-ndjson"):
                for line in resp.text.splitlines():
                    event = json.loads(line)
                    code = (event.get("error") or {}).get("code")
                    assert code != "internal", f"POST {path} {body[:200]!r}: {event}"

        one()


@pytest.mark.model
def test_worker_bodies(worker_http):
    _fuzz_worker(worker_http, "http.worker", EXAMPLES // 10)  # each may run the model: ~10 s in all


@pytest.mark.slow
@pytest.mark.model
def test_worker_bodies_long(worker_http):
    _fuzz_worker(worker_http, "http.worker (long)", LONG_EXAMPLES // 10)
