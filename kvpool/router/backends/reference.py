"""The router in front of kvpool's reference workers (`--engine reference`): their worker API.

    registration   GET /v1/info (the worker states its role), GET /v1/tokenizer
    polling        GET /load?events_since=N: load and the KV events of its own prefix cache in one call
    colocated      POST /v1/generate on the one worker (NDJSON `TokenEvent`s)
    disaggregated  POST /v1/prefill on the prefill worker (first token + KV handle), then
                   POST /v1/decode on the decode worker with the handle (it pulls the KV from the
                   pool); the prefill carries the pool's match the router made (`pool_chunks`), so
                   the worker does not ask the pool again
    retry          a decode that fails before it streamed anything is tried once on another decode
                   worker (same handle: the KV is in the pool)
    KV lost        a decode worker that answers that the handle's KV is gone from the pool (evicted
                   before it was read, a node lost, a damaged object it dropped) is asked to
                   generate the rest itself from the prompt and the first token (POST /v1/generate):
                   the request costs a second prefill instead of failing mid-stream.

HTTP clients: the calls on a request's path go through hop.py's lean client, the polls through
another (their own connections; a poll unanswered for 4 polls' time fails), the rest through
aiohttp. Every call carries the internal bearer token when a keyring is configured, and a
tenant's request `X-KVPool-Tenant: <id>`.

Errors: a worker that cannot be reached, breaks off, or answers 5xx or 503 (draining) raises
`BeforeFirst` when nothing was streamed yet; the worker is taken out of rotation when
unreachable, marked draining on a 503. A 4xx is the request's own fault: its `kvpool.errors`
error is raised as is. After the first event, a failure raises `Unavailable` (or the worker's
error).
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any, AsyncIterator

from kvpool import worker_api as wire
from kvpool.errors import CorruptObject, InvalidArgument, KeyNotFound, KVPoolError, Unavailable, error_from_code
from kvpool.router.backends.base import (POLL_TIMEOUT_S, READ_TIMEOUT_S, BeforeFirst, Outcome, Piece, Request,
                                         WorkerRefused, client_session, failed, get, unreachable)
from kvpool.router.hop import Hop, HopError
from kvpool.router.policy import Decision
from kvpool.security.http_guard import TENANT_HEADER, internal_headers

if TYPE_CHECKING:
    from kvpool.router.service import Router
    from kvpool.router.workers import WorkerState

log = logging.getLogger(__name__)
_JSON = {"content-type": "application/json"}


class ReferenceBackend:
    engine = "reference"
    registers_itself = True
    tenant_header = True
    kv_events = False  # reference workers send their KV events with their load

    def __init__(self, keyring: Any = None):
        self._headers = internal_headers(keyring) if keyring is not None else {}
        self.http = None
        self._hop: Hop | None = None
        self._polls: Hop | None = None

    async def start(self) -> None:
        # aiohttp, not httpx, off the request path: its asyncio client costs ~0.5 ms less per call.
        self.http = client_session(self._headers)
        self._hop = Hop(self._headers, read_timeout=READ_TIMEOUT_S)
        self._polls = Hop(self._headers, read_timeout=POLL_TIMEOUT_S)

    async def close(self) -> None:
        for client in (self._polls, self.http, self._hop):
            if client is not None:
                await client.close()

    # -- what the router learns ----------------------------------------------------------------
    async def describe(self, url: str, role: str | None) -> wire.WorkerInfo:
        return wire.decode(await get(self.http, url, "/v1/info", 5.0), wire.WorkerInfo)

    async def tokenizer(self, url: str) -> wire.TokenizerInfo:
        return wire.decode(await get(self.http, url, "/v1/tokenizer", 30.0), wire.TokenizerInfo)

    async def poll(self, state: WorkerState) -> tuple[wire.LoadReport, wire.EventsResponse | None]:
        path = f"/load?events_since={state.events_since}"
        try:
            resp = await self._polls.request(state.url, path, None)
            try:
                status, body = resp.status, await resp.read()
            finally:
                resp.release()
        except HopError as exc:
            raise (WorkerRefused if exc.refused else Unavailable)(f"worker {state.url} unreachable: {exc}") from exc
        if status != 200:
            raise Unavailable(f"worker {state.url} answered {status} to {path}: {body[:200]!r}")
        load = wire.decode(body, wire.LoadReport)
        return load, load.events

    # -- a request -----------------------------------------------------------------------------
    def run(self, host: Router, d: Decision, req: Request, out: Outcome) -> AsyncIterator[Piece]:
        tenant = req.tenant
        headers = {**_JSON, TENANT_HEADER: tenant.id} if tenant is not None else _JSON
        if d.prefill is None:
            return self._colocated(host, d, req.ids, req.max_tokens, req, out, headers, req.pool_chunks)
        return self._disaggregated(host, d, req, out, headers)

    async def _colocated(self, host: Router, d: Decision, ids: list[int], max_tokens: int, req: Request,
                         out: Outcome, headers: dict[str, str], pool_chunks: int | None) -> AsyncIterator[Piece]:
        worker = host.workers.by_name(d.decode)
        msg = wire.GenerateRequest(token_ids=ids, max_tokens=max_tokens, request_id=req.request_id,
                                   sampling=req.sampling, pool_chunks=pool_chunks)
        uncached = len(ids) - d.cached_tokens
        worker.prefill_sent(uncached)
        worker.decode_sent()
        prefilled = True
        try:
            async for event in self._stream(host, worker, "/v1/generate", msg, headers):
                head = event.prefill
                if head is not None:
                    prefilled = False
                    worker.prefill_done(uncached)
                    out.cached_tokens = head.cached_tokens
                try:
                    if event.done:
                        yield Piece(finish=event.finish_reason or "stop")
                        return
                    out.completion_tokens += 1
                    yield Piece(event.text)
                finally:  # as in _disaggregated: after the first token is on its way
                    if head is not None:
                        _learn(host, head, worker, None)
        finally:
            worker.decode_done()
            if prefilled:
                worker.prefill_done(uncached)

    async def _disaggregated(self, host: Router, d: Decision, req: Request, out: Outcome,
                             headers: dict[str, str]) -> AsyncIterator[Piece]:
        p = host.workers.by_name(d.prefill)
        head, round_trip = await self._prefill(host, p, d, req, headers)
        out.cached_tokens = head.cached_tokens
        out.completion_tokens = 1
        try:
            yield Piece(head.text)
        finally:  # the first token is on its way to the client before the router learns from it
            _learn(host, head, p, round_trip)
        msg = wire.DecodeRequest(handle=head.handle, first_token=head.first_token, max_tokens=req.max_tokens,
                                 sampling=req.sampling)
        tried: list[str] = [p.name] if p.role == "prefill" else []
        decoder = host.workers.by_name(d.decode)
        lost: KVPoolError | None = None
        for attempt in range(2):
            decoder.decode_sent()
            try:
                async for event in self._stream(host, decoder, "/v1/decode", msg, headers):
                    if event.done:
                        yield Piece(finish=event.finish_reason or "stop")
                        return
                    out.completion_tokens += 1
                    yield Piece(event.text)
                return
            except (KeyNotFound, CorruptObject) as exc:  # the worker says the handle's KV is gone
                lost = exc
                break
            except BeforeFirst as exc:  # the handle still names the KV in the pool: another decoder
                tried.append(decoder.name)
                if isinstance(exc.error, (KeyNotFound, CorruptObject)):
                    lost = exc.error
                    break
                if attempt == 1 or isinstance(exc.error, InvalidArgument):
                    raise exc.error from None
                alt = host.another_decoder(req.keys, tried, req.tenant.id if req.tenant is not None else None)
                if alt is None:
                    raise exc.error from None
                host.metrics.retries.labels(stage="decode").inc()
                log.warning("request %s: decode retried on %s after %s", req.request_id, alt.name, exc.error)
                decoder = alt
            finally:
                decoder.decode_done()
        if lost is not None:  # recompute on the decode worker: prompt + first token, the rest of the budget
            if req.max_tokens < 2:  # (a decode worker loads nothing for a one-token budget: not reached)
                raise lost
            host.metrics.retries.labels(stage="kv_lost").inc()
            log.warning("request %s: %s; %s generates the rest from the prompt", req.request_id, lost, decoder.name)
            again = Decision(prefill=None, decode=decoder.name, kind="local_prefill")
            try:
                async for piece in self._colocated(host, again, [*req.ids, head.first_token], req.max_tokens - 1,
                                                   req, out, headers, None):  # the pool changed: let it ask
                    yield piece
            except BeforeFirst as exc:  # the first token already reached the client: no retry elsewhere
                raise exc.error from None

    async def _prefill(self, host: Router, p: "WorkerState", d: Decision, req: Request,
                       headers: dict[str, str]) -> tuple[wire.PrefillResponse, float]:
        """The worker's answer, and the call's round trip in seconds."""
        uncached = len(req.ids) - d.cached_tokens
        p.prefill_sent(uncached)
        sent = time.perf_counter()
        try:
            body = await self._post(host, p, "/v1/prefill", wire.PrefillRequest(
                token_ids=req.ids, request_id=req.request_id, sampling=req.sampling, pool_chunks=req.pool_chunks),
                headers)
            round_trip = time.perf_counter() - sent
            head = wire.decode(body, wire.PrefillResponse)
        finally:
            p.prefill_done(uncached)
        return head, round_trip

    # -- the calls and what their failures mean --------------------------------------------------
    async def _post(self, host: Router, worker: WorkerState, path: str, msg: Any,
                    headers: dict[str, str]) -> bytes:
        """The body of a 2xx answer; a worker that fails or answers 5xx/503 raises `BeforeFirst`."""
        try:
            resp = await self._hop.request(worker.url, path, wire.encode(msg), headers)
            try:
                body = await resp.read()
            finally:
                resp.release()
        except HopError as exc:
            raise unreachable(host, worker, path, exc, streamed=False) from None
        if resp.status >= 400:
            raise _error_of(host, worker, path, resp.status, body)
        return body

    async def _stream(self, host: Router, worker: "WorkerState", path: str, msg: Any,
                      headers: dict[str, str]) -> AsyncIterator[wire.TokenEvent]:
        """The NDJSON `TokenEvent`s of /v1/decode or /v1/generate."""
        got_any = False
        resp = None
        try:
            resp = await self._hop.request(worker.url, path, wire.encode(msg), headers)
            if resp.status >= 400:
                raise _error_of(host, worker, path, resp.status, await resp.read())
            async for line in resp.lines():  # NDJSON: one event per line
                if not line.strip():
                    continue
                event = wire.decode(line, wire.TokenEvent)
                if event.error is not None:
                    raise failed(worker.name, error_from_code(event.error.code, event.error.message), got_any)
                got_any = True
                if event.done:  # the body ends right after: read its end and pool the connection now
                    await resp.read()
                    resp.release()
                    yield event
                    return
                yield event
        except HopError as exc:
            raise unreachable(host, worker, path, exc, got_any) from None
        finally:
            if resp is not None:
                resp.release()  # closes the connection unless the stream was read to its end


def _error_of(host: Router, worker: "WorkerState", path: str, status: int, body: bytes) -> Exception:
    try:
        doc = json.loads(body)
        err = error_from_code(doc["code"], doc["message"])
    except Exception:
        err = Unavailable(f"worker {worker.name} answered {status} to {path}")
    if status >= 500 or isinstance(err, Unavailable):  # down or draining: try elsewhere
        host.metrics.worker_failures.labels(stage=path.rsplit("/", 1)[-1]).inc()
        if status == 503:  # a worker answers 503 only when leaving
            host.workers.leaving(worker)
        return BeforeFirst(worker.name, err)
    return err


def _learn(host: Router, head: wire.PrefillResponse, worker: WorkerState, round_trip_s: float | None) -> None:
    """Feed the cost model (and refit it now, so that the next route finds it fitted) and the
    token counters. Called once the first token is on its way: none of this is on TTFT."""
    fetched = head.pool_cached_tokens * (worker.info.stored_bytes_per_token or worker.info.bytes_per_token
                                         or host.bytes_per_token)
    host.cost.observe_prefill(head.computed_tokens, head.cached_tokens, head.compute_ms / 1e3,
                              fetched, head.fetch_ms / 1e3)
    if worker.role == "prefill" and round_trip_s is not None:  # the push plus the HTTP round trip
        http = round_trip_s - head.prefill_ms / 1e3  # (queue wait is not hand-off)
        host.cost.observe_handoff(max(0.0, head.push_ms / 1e3 + http))
    host.metrics.prompt_tokens.labels(source="cached").inc(head.cached_tokens)
    host.metrics.prompt_tokens.labels(source="computed").inc(head.computed_tokens)
    host.cost.params()

