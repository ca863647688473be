"""The worker's HTTP control API (FastAPI). Thin: parse a declared message, call the worker,
encode the answer. KV bytes never travel here (see `kvpool/worker_api.py`).

    GET  /health            200 {"status": "ok", "role": ...} once the model is loaded;
                            503 {"status": "draining", "role": ...} after SIGTERM (routers stop sending)
    GET  /metrics           Prometheus text
    GET  /load              LoadReport: queues, KV tokens, decode step time, open streams, draining
    GET  /v1/info           WorkerInfo: model, namespace, chunk size, EOS ids, context length, KV bytes/token,
                            KV codec (how its chunks are stored in the pool)
    GET  /v1/tokenizer      TokenizerInfo: tokenizer JSON, chat template, special tokens (tokenize in a router)
    GET  /v1/events?since=N KV events (local prefix cache, pool writes) after N
                            (`/load?events_since=N` gives them with the load: a router's poll)
    POST /v1/tokenize       TokenizeRequest -> TokenizeResponse
    POST /v1/prefill        PrefillRequest -> PrefillResponse          (prefill, both)
    POST /v1/decode         DecodeRequest -> NDJSON TokenEvent stream   (decode, both)
    POST /v1/generate       GenerateRequest -> NDJSON TokenEvent stream (decode, both)
    POST /v1/cache/clear    empty the local prefix cache (benchmarks, tests, operators)

While draining, prefill/decode/generate answer 503 `unavailable` ("... draining ..."); streams
already open run to their end.

Guard (kvpool.security.http_guard): a request body over 1 MiB is answered 413; with a keyring configured
(`KVPOOL_AUTH_FILE`), every path but /health needs `Authorization: Bearer <internal token>` (derived
from the keyring's node secret: the router and these workers share the keyring), else 401.

Tenant: prefill, decode and generate run for the tenant named by the `X-KVPool-Tenant` header
(the router sets it, next to the bearer token; see `tenants.py`); without it, untenanted.

Errors are `{"code", "message"}` with the status of the `kvpool.errors` class; an unexpected
exception is logged here and answered 500 `internal`, never a traceback to the client.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvpool import worker_api as m
from kvpool.errors import KVPoolError
from kvpool.security.http_guard import TENANT_HEADER, HttpGuard, internal_token, metrics_token

log = logging.getLogger(__name__)


def _json(msg: Any, status: int = 200) -> Response:
    return Response(content=m.encode(msg), media_type="application/json", status_code=status)


async def _ndjson(events: AsyncIterator[m.TokenEvent], worker: Any) -> AsyncIterator[bytes]:
    rid = ""
    try:
        async for event in events:
            rid = event.request_id
            if event.error is not None:
                worker.metrics.error(event.error.code)
            yield m.encode(event) + b"\n"
    except Exception as exc:  # mid-stream: the status is sent already, so end with an error line
        log.exception("stream %s failed", rid)
        worker.metrics.error(getattr(exc, "code", "internal"))
        yield m.encode(m.error_event(rid, exc)) + b"\n"


def create_app(worker: Any) -> FastAPI:
    app = FastAPI(title=f"kvpool {worker.config.role} worker", version=str(m.WIRE_VERSION))
    token = internal_token()  # None without a keyring: nothing to check
    scraper = metrics_token() if token else None  # with a keyring, a scraper's token opens /metrics too
    app.add_middleware(HttpGuard, token=lambda: token, what=f"the {worker.config.role} worker",
                       metrics_token=lambda: scraper)

    @app.exception_handler(KVPoolError)
    async def _kvpool_error(request: Request, exc: KVPoolError) -> JSONResponse:
        worker.metrics.error(exc.code)
        if exc.http_status >= 500:
            log.warning("%s %s failed: %s", request.method, request.url.path, exc)
        return JSONResponse({"code": exc.code, "message": str(exc)}, status_code=exc.http_status)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        worker.metrics.error("internal")
        return JSONResponse({"code": "internal", "message": f"{type(exc).__name__}: {exc}"}, status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        if worker.admission.draining:
            return JSONResponse({"status": "draining", "role": worker.config.role}, status_code=503)
        return JSONResponse({"status": "ok", "role": worker.config.role})

    @app.get("/metrics", response_class=Response)  # Prometheus text, so the OpenAPI spec says so
    async def metrics() -> Response:
        return Response(worker.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/load")
    async def load(events_since: int | None = None) -> Response:
        report = worker.load()
        if events_since is not None:  # a router's poll: the KV events too, in the same answer
            report = msgspec.structs.replace(report, events=worker.events.since(events_since, 1000))
        return _json(report)

    @app.get("/v1/info")
    async def info() -> Response:
        return _json(worker.info())

    @app.get("/v1/tokenizer")
    async def tokenizer() -> Response:
        return _json(await asyncio.to_thread(worker.tokenizer_info))  # the first call builds it (~1.5 MB)

    @app.get("/v1/events")
    async def events(since: int = 0, limit: int = 1000) -> Response:
        return _json(worker.events.since(since, max(1, min(limit, 10000))))

    @app.post("/v1/tokenize")
    async def tokenize(request: Request) -> Response:
        req = m.decode(await request.body(), m.TokenizeRequest)
        return _json(m.TokenizeResponse(token_ids=worker.tokenize(req)))

    @app.post("/v1/prefill")
    async def prefill(request: Request) -> Response:
        req = m.decode(await request.body(), m.PrefillRequest)
        return _json(await worker.prefill(req, tenant=request.headers.get(TENANT_HEADER)))

    @app.post("/v1/decode")
    async def decode(request: Request) -> StreamingResponse:
        req = m.decode(await request.body(), m.DecodeRequest)
        stream = await worker.open_decode(req, tenant=request.headers.get(TENANT_HEADER))
        return StreamingResponse(_ndjson(stream, worker), media_type=m.NDJSON)

    @app.post("/v1/generate")
    async def generate(request: Request) -> StreamingResponse:
        req = m.decode(await request.body(), m.GenerateRequest)
        stream = await worker.open_generate(req, tenant=request.headers.get(TENANT_HEADER))
        return StreamingResponse(_ndjson(stream, worker), media_type=m.NDJSON)

    @app.post("/v1/cache/clear")
    async def clear_cache() -> dict:
        return {"removed_chunks": worker.cache.clear()}

    return app
