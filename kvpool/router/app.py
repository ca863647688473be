"""The router's HTTP face (FastAPI): the OpenAI API, health, metrics and worker admin. Thin:
parse, call `Router`, shape the answer (see `openai_api.py`).

    POST /v1/chat/completions   POST /v1/completions   (stream or not; answered by `OpenAIFront`)
    GET  /v1/models             GET  /health            GET /metrics
    GET  /admin/workers         POST /admin/workers {"url"[, "role", "kv_events"]}   (a worker joins; idempotent)
    POST /admin/workers/drain {"url"}  (no new requests; it leaves once idle)
    DELETE /admin/workers?url=URL      (forget it now)
    GET  /admin/route?prompt=...       (the decision for a prompt, without running it)
    GET  /admin/stats                  (hit rates by source, tenant and pool tier: observe.py)
    GET  /dashboard                    (the built-in dashboard page: dashboard.html, polls ...)
    GET  /dashboard/data               (... every metric sample of the router, workers and pool)

Guard: a request body over 1 MiB is answered 413 (kvpool.security.http_guard, in OpenAI's error shape).
With a keyring (`KVPOOL_AUTH_FILE`) whose tenants have `api_keys`, `/v1/*` needs
`Authorization: Bearer <API key>` and runs as that key's tenant (service.py); no key or a wrong
one is a 401 shaped as OpenAI's. With any keyring, `/admin/*`, `/metrics` and `/dashboard/data`
need the internal token (workers registering themselves hold it; see docs/security.md); `/health`
and the dashboard page itself (no data in it) stay open.
Prompts are tokenized on a thread pool, off the event loop (short ones excepted: Router.tokenized).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvpool import worker_api as wire
from kvpool.security.keyring import Entry
from kvpool.errors import InvalidArgument, KVPoolError, Unavailable
from kvpool.security.http_guard import HttpGuard, internal_token, metrics_token
from kvpool.router import observe, openai_api as oa
from kvpool.router.kv_events import KVEventsSource
from kvpool.router.service import Outcome, Piece, Rejected, Router

log = logging.getLogger(__name__)
DASHBOARD_PAGE = Path(__file__).with_name("dashboard.html")


def _error_response(exc: Exception) -> JSONResponse:
    err = _as_openai(exc)
    return JSONResponse(err.body(), status_code=err.http_status)


def _as_openai(exc: Exception) -> oa.OpenAIError:
    if isinstance(exc, oa.OpenAIError):
        return exc
    if isinstance(exc, Rejected):
        d = exc.decision
        return oa.OpenAIError(429, f"{exc} (estimated TTFT {d.est_ttft_s * 1e3:.0f} ms, time between tokens "
                              f"{d.est_tbt_s * 1e3:.0f} ms); retry later", type_="requests",
                              code="rate_limit_exceeded")
    if isinstance(exc, InvalidArgument):
        return oa.bad_request(str(exc))
    if isinstance(exc, Unavailable):
        return oa.OpenAIError(503, str(exc), type_="service_unavailable", code="service_unavailable")
    if isinstance(exc, KVPoolError):
        return oa.OpenAIError(exc.http_status if exc.http_status >= 400 else 500, str(exc),
                              type_="server_error", code=exc.code)
    return oa.OpenAIError(500, "internal error (see the router's log)", type_="server_error", code="internal")


def _sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def create_app(router: Router) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="kvpool router", lifespan=lifespan)
    token = internal_token(router.keyring) if router.keyring is not None else None
    app.add_middleware(OpenAIFront, router=router)  # inside the guard: added first
    scraper = metrics_token() if token else None  # with a keyring, a scraper's token opens /metrics too
    app.add_middleware(HttpGuard, token=lambda: token, what="this router", metrics_token=lambda: scraper,
                       needs_token=lambda path: path.startswith("/admin") or path in ("/metrics", "/dashboard/data"),
                       error_body=lambda status, code, message: oa.OpenAIError(status, message, code=code).body())

    # KVPoolError (OpenAIError included) is an answer, not a crash: handled inside the app. A
    # handler for Exception runs in Starlette's outermost middleware, which re-raises afterwards.
    @app.exception_handler(KVPoolError)
    async def _expected(request: Request, exc: KVPoolError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return _error_response(exc)

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = router.ready()
        workers = router.workers.by_url.values() if router.workers else []
        return JSONResponse({"status": "ok" if ok else "waiting for workers",
                             "workers": {s.name: s.status for s in workers}}, status_code=200 if ok else 503)

    @app.get("/metrics", response_class=Response)  # Prometheus text, so the OpenAPI spec says so
    async def metrics() -> Response:
        return Response(router.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        _tenant_of(router, request.headers.get("authorization"))
        name = router.model_name
        data = [] if name is None else [{"id": name, "object": "model", "created": 0, "owned_by": "kvpool"}]
        return {"object": "list", "data": data}

    @app.get("/admin/workers")
    async def list_workers() -> dict:
        return {"policy": router.policy.name, "workers": [s.summary() for s in router.workers.by_url.values()],
                "cost": router.cost.params().__dict__, "cost_samples": router.cost.samples}

    @app.get("/admin/stats")
    async def cluster_stats() -> dict:
        """Hit rates: prompt tokens and chunks by source over the workers, per tenant, and the
        pool's tiers (`kvpool admin stats --router`; `observe.py`)."""
        return observe.hit_summary(await observe.snapshot(router))

    @app.get("/dashboard", response_class=Response)
    async def dashboard() -> Response:
        """The built-in dashboard: the Grafana panels without Grafana (no CDN, no build step)."""
        return Response(DASHBOARD_PAGE.read_bytes(), media_type="text/html; charset=utf-8",
                        headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/data")
    async def dashboard_data() -> dict:
        return await observe.snapshot(router)

    @app.post("/admin/workers")
    async def add_worker(request: Request) -> dict:
        body = _json_body(await request.body())
        role = body.get("role") if isinstance(body, dict) else None  # vLLM servers (--engine vllm) only
        events = body.get("kv_events") if isinstance(body, dict) else None  # vLLM: "ENDPOINT[,REPLAY]"
        if events is not None and not isinstance(events, str):
            raise InvalidArgument('"kv_events" is a string: "ENDPOINT[,REPLAY_ENDPOINT]"')
        return (await router.workers.register(_url_of(body), role if isinstance(role, str) else None,
                                              KVEventsSource.parse(events) if events else None)).summary()

    @app.post("/admin/workers/drain")
    async def drain_worker(request: Request) -> dict:
        return router.workers.drain(_url_of(_json_body(await request.body()))).summary()

    @app.delete("/admin/workers")
    async def remove_worker(url: str) -> dict:
        return router.workers.remove(url).summary()

    @app.get("/admin/route")
    async def explain(prompt: str, max_tokens: int = 16) -> dict:
        if router.tokenizer is None:
            raise Unavailable("no worker has registered yet")
        ids, u32 = await router.tokenized(len(prompt), router.tokenizer.encode_prompt, prompt)
        decision, req, _ = await router.route(ids, max_tokens, None, u32)
        return {"decision": decision.__dict__, "request": req.__dict__}

    return app


class OpenAIFront:
    """ASGI middleware that answers POST /v1/chat/completions and /v1/completions itself, every
    other request going on to the FastAPI app. These two are on every request's TTFT, and
    FastAPI's routing, request object and StreamingResponse cost ~0.3 ms of it here (BENCHMARKS.md,
    router section). Errors are OpenAI-shaped as the app's own handlers shape them; a stream
    whose client disconnects is cancelled (its worker streams are closed)."""

    PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}

    def __init__(self, app: Any, router: Router):
        self.app = app
        self.router = router

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        endpoint = self.PATHS.get(scope["path"]) if scope["type"] == "http" else None
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        try:
            if scope["method"] != "POST":
                raise oa.OpenAIError(405, f"{scope['method']} is not allowed on {scope['path']}: POST it",
                                     code="method_not_allowed")
            body, more = b"", True
            while more:
                message = await receive()
                if message["type"] != "http.request":  # the client went away
                    return
                body += message.get("body", b"")
                more = message.get("more_body", False)
            auth = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
            answer = await _answer(self.router, endpoint, auth, _json_body(body))
        except Exception as exc:
            if not isinstance(exc, KVPoolError):
                log.exception("POST %s failed", scope["path"])
            err = _as_openai(exc)
            await _send_json(send, err.http_status, err.body())
            return
        if isinstance(answer, dict):
            await _send_json(send, 200, answer)
        else:
            await _send_stream(answer, receive, send)


async def _send_json(send: Any, status: int, doc: Any) -> None:
    data = msgspec.json.encode(doc)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


async def _send_stream(chunks: AsyncIterator[bytes], receive: Any, send: Any) -> None:
    """Server-sent events until `chunks` ends or the client disconnects (then `chunks` is closed).
    The first event is sent from this task: a task of its own would start one loop turn later."""
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]})
    try:
        try:
            first = await anext(chunks)  # the request's first token: already in hand (see _complete)
        except StopAsyncIteration:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        await send({"type": "http.response.body", "body": first, "more_body": True})

        async def pump() -> None:
            async for data in chunks:
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def disconnected() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        streaming, gone = asyncio.ensure_future(pump()), asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait((streaming, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streaming, gone):
                task.cancel()
            for task in (streaming, gone):  # wait for both to end (a cancelled one ends as CancelledError)
                (result,) = await asyncio.gather(task, return_exceptions=True)
                if isinstance(result, Exception):
                    log.warning("a stream ended early: %r", result)
    finally:
        await chunks.aclose()  # cancelled mid-stream: its cleanup (the workers' streams closed) runs here


def _json_body(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise oa.bad_request(f"the request body is not valid JSON: {exc}") from None


def _tenant_of(router: Router, authorization: str | None) -> Entry | None:
    """The keyring entry of the request's API key; None when API keys are off."""
    if not router.tenants.api_keys:
        return None
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise oa.missing_api_key()
    entry = router.keyring.tenant_of_api_key(key.strip())
    if entry is None:
        raise oa.invalid_api_key(key.strip())
    return entry


async def _answer(router: Router, endpoint: str, auth: str | None, body: Any) -> dict | AsyncIterator[bytes]:
    entry = _tenant_of(router, auth)
    req = oa.parse(oa.ChatRequest if endpoint == "chat" else oa.CompletionRequest, body)
    if router.tokenizer is None:
        raise Unavailable("no worker has registered with this router yet")
    if req.model != router.model_name and req.model != router.workers.model_id:
        raise oa.OpenAIError(404, f"The model `{req.model}` does not exist.", code="model_not_found",
                             param="model")
    u32 = None
    if endpoint == "chat":
        messages = req.chat()
        try:
            ids, u32 = await router.tokenized(sum(len(m["content"]) for m in messages),
                                              router.tokenizer.encode_chat_prompt, messages)
        except ValueError as exc:
            raise oa.bad_request(str(exc), param="messages") from None
    elif isinstance(req.prompt, str):
        ids, u32 = await router.tokenized(len(req.prompt), router.tokenizer.encode_prompt, req.prompt)
    else:
        ids = list(req.prompt)
        if any(t < 0 for t in ids):
            raise oa.bad_request("prompt token ids must not be negative", param="prompt")
    return await _complete(router, endpoint, req, ids, entry, u32)


def _url_of(body: Any) -> str:
    if not isinstance(body, dict) or not isinstance(body.get("url"), str):
        raise oa.bad_request('expected {"url": "http://HOST:PORT"}')
    return body["url"]


async def _complete(router: Router, endpoint: str, req: Any, ids: list[int], entry: Entry | None,
                    u32: bytes | None) -> dict | AsyncIterator[bytes]:
    """The whole answer (not streaming), or its server-sent events. Without max_tokens, a chat
    request may take `default_max_tokens`, a completion 16 (OpenAI's default)."""
    arrived = time.perf_counter()
    budget = req.token_budget()
    context = router.max_positions
    if not ids:
        raise oa.bad_request("the prompt has no tokens", param="prompt")
    if len(ids) >= context or (budget is not None and len(ids) + budget > context):
        raise oa.bad_request(f"This model's maximum context length is {context} tokens. However, you requested "
                             f"{len(ids) + (budget or 0)} tokens ({len(ids)} in the prompt, {budget or 0} for the "
                             "completion). Please reduce the length of the prompt or completion.",
                             param="messages" if endpoint == "chat" else "prompt", code="context_length_exceeded")
    default_budget = router.config.default_max_tokens if endpoint == "chat" else 16
    max_tokens = budget if budget is not None else min(default_budget, context - len(ids))
    temperature = 1.0 if req.temperature is None else req.temperature
    sampling = wire.SamplingParams(temperature=temperature, top_p=1.0 if req.top_p is None else req.top_p,
                                   seed=req.seed if req.seed is not None else uuid.uuid4().int & 0x7FFFFFFF)
    shape = oa.Shape(endpoint == "chat", req.model, include_usage=bool(req.stream_options
                                                                       and req.stream_options.include_usage))
    out = Outcome()
    pieces = router.generate(ids, max_tokens, sampling, out, shape.id, entry, u32)
    stops = oa.StopMatcher(req.stop)
    if not req.stream:
        text, finish = "", "stop"
        try:
            async for piece in pieces:
                text += stops.push(piece.text)
                if stops.hit:
                    break
                if piece.finish:
                    finish = piece.finish
        except Exception as exc:
            router.metrics.done(endpoint, _as_openai(exc).http_status)
            raise
        finally:
            await pieces.aclose()
        text += stops.flush()
        router.metrics.done(endpoint, 200)
        _account(router, out, arrived, ttft=None)
        return shape.whole(text, "stop" if stops.hit else finish, oa.usage(out))
    # Streaming: pull the first piece before answering, so errors before it get a status code.
    try:
        first = await anext(pieces)
    except StopAsyncIteration:
        first = Piece(finish="stop")
    except Exception as exc:
        await pieces.aclose()
        router.metrics.done(endpoint, _as_openai(exc).http_status)
        raise
    return _sse_stream(router, endpoint, shape, first, pieces, stops, out, arrived)


async def _sse_stream(router: Router, endpoint: str, shape: oa.Shape, first: Any, pieces: AsyncIterator,
                      stops: oa.StopMatcher, out: Outcome, arrived: float) -> AsyncIterator[bytes]:
    ttft = time.perf_counter() - arrived
    status = 200
    try:
        piece, opened = first, False
        while True:
            text = stops.push(piece.text)
            finish = "stop" if stops.hit else piece.finish
            if finish is not None:
                text += stops.flush()
            if text or not opened:
                yield _sse(shape.chunk(text, first=not opened))
                opened = True
            if finish is not None:
                yield _sse(shape.chunk(None if shape.chat else "", finish=finish))
                break
            piece = await anext(pieces)
        if shape.include_usage:
            yield _sse(shape.usage_chunk(oa.usage(out)))
    except StopAsyncIteration:
        yield _sse(shape.chunk(None if shape.chat else "", finish="stop"))
    except Exception as exc:  # the status line is sent: end the stream with an error event
        err = _as_openai(exc)
        status = err.http_status
        if not isinstance(exc, KVPoolError):
            log.exception("stream %s failed", shape.id)
        else:
            log.warning("stream %s failed: %s", shape.id, exc)
        yield _sse(err.body())
    finally:
        await pieces.aclose()
        router.metrics.done(endpoint, status)
        if status == 200:
            _account(router, out, arrived, ttft)
    yield b"data: [DONE]\n\n"


def _account(router: Router, out: Outcome, arrived: float, ttft: float | None) -> None:
    if ttft is not None:
        router.metrics.ttft.observe(ttft)
    router.metrics.e2e.observe(time.perf_counter() - arrived)
    router.metrics.completion_tokens.inc(out.completion_tokens)
