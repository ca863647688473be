"""The router: one request from token ids to a stream of text pieces, through the chosen workers.

    route:    chunk keys of the prompt -> one match_prefix to the pool -> a snapshot of the
              workers (load, what each holds locally) -> the policy's decision
    execute:  disaggregated: POST /v1/prefill on the prefill worker (first token + KV handle),
              then POST /v1/decode on the decode worker with the handle (it pulls the KV from
              the pool); otherwise POST /v1/generate on the one worker that does both
    retry:    a worker that cannot be reached, or fails before anything was streamed, is taken
              out of rotation and the step is tried once more elsewhere: a prefill on another
              prefill worker, a decode (same handle: the KV is in the pool) on another decode
              worker. After the first token is sent, a failure ends the stream with an error.
    KV lost:  a decode worker that answers that the handle's KV is gone from the pool (evicted
              before it was read, a node lost, a damaged object it dropped) is asked to
              generate the rest itself from the prompt and the first token (POST /v1/generate):
              the request costs a second prefill instead of failing mid-stream.

Tenants (with a keyring whose tenants have `api_keys`, see app.py and tenants.py): a request
runs as the tenant its API key names: its chunk keys are in that tenant's salted namespace,
`match_prefix` asks the pool as its principal, and each call to a worker carries
`X-KVPool-Tenant: <id>`. Every call to a reference worker carries the internal bearer token when
a keyring is configured.

Invariants: the router never holds KV bytes (handles name pool objects); every request it
counts in flight on a worker (`inflight_*`) is uncounted exactly once, however it ends; the
cost model only learns from successful prefills.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable

import aiohttp

from kvpool import worker_api as wire
from kvpool.config import Settings, default
from kvpool.security.keyring import Entry, load_keyring
from kvpool.errors import CorruptObject, InvalidArgument, KeyNotFound, KVPoolError, Unavailable
from kvpool.security.http_guard import TENANT_HEADER, internal_headers
from kvpool.keys import chunk_keys_hex, chunk_keys_hex_u32, parse_namespace_hex
from kvpool.router.backends.reference import WorkerCalls, _BeforeFirst
from kvpool.router.cost import CostModel
from kvpool.router.hop import Hop
from kvpool.router.kv_events import parse_kv_events
from kvpool.router.matcher import PrefixMatcher
from kvpool.router.metrics import RouterMetrics
from kvpool.router.policy import (Decision, RouteRequest, Snapshot, Targets, make_policy, prefill_estimate,
                                  tbt_estimate, without_workers)
from kvpool.router.tenants import Tenant, Tenants
from kvpool.router.tokenizer import RouterTokenizer
from kvpool.router.backends.vllm import VLLMSettings, make_backend
from kvpool.router.workers import DOWN, DRAINING, UP, Workers, WorkerState

log = logging.getLogger(__name__)

INLINE_CHARS = 1024  # a prompt this short is tokenized on the event loop (Router.tokenized)


@dataclass
class RouterConfig:
    """The router's run-time configuration; `from_settings` makes it from the tree's `[router]`,
    whose defaults these are (kvpool.config)."""

    pool: str | None = None  # pool address for match_prefix; None: only the workers' own caches count
    policy: str = default("router.policy")
    ttft_slo_s: float | None = None  # admission: refuse when the best estimate is above it
    tbt_slo_s: float | None = None
    local_prefill_tokens: int = default("router.local_prefill_tokens")  # this small: prefilled on the decode worker
    default_max_tokens: int = default("router.default_max_tokens")  # chat requests without max_tokens (completions: 16)
    model_name: str | None = None  # the name /v1/models lists; default: the workers' model id
    poll_s: float = 0.25
    fail_after: int = 3
    request_timeout_s: float = 600.0
    workers: list[str] = field(default_factory=list)  # "URL" or "ROLE=URL" (the role: --engine vllm only)
    engine: str = default("router.engine")  # the workers': "reference" (reference workers) or "vllm" (backends/vllm.py)
    vllm: Any = None  # VLLMSettings, with engine "vllm"
    auth_file: str | None = None  # keyring (default: KVPOOL_AUTH_FILE); its tenants' api_keys admit requests
    tokenize_threads: int = 4  # prompts are tokenized on these threads, off the event loop
    # --engine vllm: "URL=ENDPOINT[,REPLAY_ENDPOINT]", where the server at URL publishes its KV events
    # (vLLM's --kv-events-config): the router follows them as that server's own cache (kv_events.py)
    kv_events: list[str] = field(default_factory=list)

    @classmethod
    def from_settings(cls, settings: Settings) -> "RouterConfig":
        r = settings.router
        vllm = None
        if r.engine == "vllm":
            if not r.tokenizer:
                raise InvalidArgument("a router for vLLM servers (engine vllm) needs the model folder they load: "
                                      "--tokenizer DIR ([router] tokenizer)")
            vllm = VLLMSettings(model_path=r.tokenizer, connector=dict(r.kv_connector_config), kv_dtype=r.kv_dtype)
        return cls(pool=r.pool, policy=r.policy, workers=list(r.workers),
                   ttft_slo_s=None if r.ttft_slo_ms is None else r.ttft_slo_ms / 1e3,
                   tbt_slo_s=None if r.tbt_slo_ms is None else r.tbt_slo_ms / 1e3,
                   local_prefill_tokens=r.local_prefill_tokens, default_max_tokens=r.default_max_tokens,
                   model_name=r.model_name, engine=r.engine, vllm=vllm, auth_file=settings.security.auth_file,
                   kv_events=list(r.kv_events))


@dataclass
class Piece:
    text: str = ""
    finish: str | None = None  # "stop" | "length" on the last piece


@dataclass
class Outcome:
    """What one request did, filled in while it streams."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    decision: Decision | None = None
    route_s: float = 0.0


class Router(WorkerCalls):
    def __init__(self, config: RouterConfig):
        self.config = config
        self.policy = make_policy(config.policy)
        self.cost = CostModel()
        self.targets = Targets(ttft_s=config.ttft_slo_s, tbt_s=config.tbt_slo_s,
                               local_prefill_tokens=config.local_prefill_tokens)
        self.tokenizer: RouterTokenizer | None = None
        self.max_positions = 0
        self.chunk_tokens = 0
        self.bytes_per_token = 0
        self.eos_ids: list[int] = []
        self._namespace: bytes | None = None
        self._seq = 0
        self.pool: Any = None  # a PrefixMatcher (matcher.py), or anything with `async match(keys)`
        self.http: aiohttp.ClientSession | None = None
        self.hop: Hop | None = None
        self.workers: Workers | None = None
        self.metrics = RouterMetrics(self.policy.name, self._pressure, self._worker_counts)
        self.backend = make_backend(config.engine, config.vllm)  # None: the reference workers' API
        self.kv_events = parse_kv_events(config.kv_events)
        if self.kv_events and self.backend is None:
            raise InvalidArgument("--kv-events is for vLLM servers (--engine vllm); reference workers send "
                                  "their KV events with their load")
        self._joining: list[asyncio.Task] = []
        self.keyring = load_keyring(config.auth_file)
        self.tenants = Tenants(self.keyring, config.pool, via_cache_salt=self.backend is not None)
        self.api_keys = self.tenants.api_keys  # app.py admits only requests with a tenant's API key
        self._join_lock = asyncio.Lock()
        self._tokenize = ThreadPoolExecutor(max(1, config.tokenize_threads), thread_name_prefix="tokenize")

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> "Router":
        # aiohttp, not httpx: its asyncio client costs ~0.5 ms less per call here, and the prefill
        # call is on every request's TTFT.
        # The internal token goes to reference workers only (a vLLM server has its own --api-key).
        headers = internal_headers(self.keyring) if self.keyring is not None and self.backend is None else {}
        self.http = aiohttp.ClientSession(
            headers=headers, connector=aiohttp.TCPConnector(limit=1024, ttl_dns_cache=300),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=self.config.request_timeout_s))
        # The calls on a request's path (prefill, decode, generate) go through the leaner hop.py.
        self.hop = Hop(headers, read_timeout=self.config.request_timeout_s)
        self.workers = Workers(self.http, poll_s=self.config.poll_s, fail_after=self.config.fail_after,
                               on_join=self._on_join, on_load=self._on_load, backend=self.backend,
                               headers=headers, kv_events=self.kv_events)
        own = self.keyring.own_credential() if self.keyring is not None else None
        if self.config.pool and (self.keyring is None or own is not None):
            # untenanted requests' match_prefix; a keyring of tenants only (no node secret: least
            # privilege) has no principal of its own, and then every request is a tenant's anyway
            self.pool = await PrefixMatcher(self.config.pool, credential=own).connect()
        for spec in self.config.workers:
            role, _, url = spec.partition("=") if "=" in spec.split("://", 1)[0] else ("", "", spec)
            try:
                await self.workers.register(url, role or None)
            except KVPoolError as exc:
                log.warning("worker %s not registered yet: %s (it can register itself later)", url, exc)
                if self.backend is not None:  # a vLLM server never registers itself: keep asking
                    self._joining.append(asyncio.create_task(self._register_later(url, role or None)))
        self.workers.start()
        return self

    async def _register_later(self, url: str, role: str | None) -> None:
        while True:
            await asyncio.sleep(2.0)
            try:
                await self.workers.register(url, role)
                return
            except KVPoolError as exc:
                log.debug("worker %s not registered yet: %s", url, exc)

    async def stop(self) -> None:
        for task in self._joining:
            task.cancel()
        if self.workers is not None:
            await self.workers.stop()
        if self.http is not None:
            await self.http.close()
        if self.hop is not None:
            await self.hop.close()
        await self.tenants.close()
        if self.pool is not None:
            with contextlib.suppress(Exception):
                await self.pool.close()
        self._tokenize.shutdown(wait=False, cancel_futures=True)

    async def tokenized(self, chars: int, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)`, a tokenizer call on a prompt of `chars` characters: on the tokenizing
        threads, since a 100k-token prompt takes ~0.1 s to render and encode, which must not stall
        the other requests' streams; a prompt of at most `INLINE_CHARS` right here (~0.2 ms at
        most), where the hand-off to a thread would cost as much as the work."""
        if chars <= INLINE_CHARS:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._tokenize, fn, *args)

    async def _on_join(self, url: str, info: wire.WorkerInfo) -> None:
        """The first worker teaches the router the model: tokenizer, context, chunking. Workers
        joining at once wait for the first to finish (one tokenizer built, not one each)."""
        async with self._join_lock:
            if self.tokenizer is None:
                await self._learn_model(url, info)

    async def _learn_model(self, url: str, info: wire.WorkerInfo) -> None:
        if self.backend is not None:  # an engine without /v1/tokenizer: read from its model folder
            tok = self.backend.tokenizer_info()
        else:
            async with self.http.get(url + "/v1/tokenizer", timeout=aiohttp.ClientTimeout(total=30.0)) as resp:
                if resp.status != 200:
                    raise Unavailable(f"worker {url} did not give its tokenizer ({resp.status})")
                tok = wire.decode(await resp.read(), wire.TokenizerInfo)
        self.tokenizer = await asyncio.to_thread(RouterTokenizer.from_info, tok)
        self.max_positions = info.max_positions or 8192
        self.chunk_tokens = info.chunk_tokens
        self.bytes_per_token = info.stored_bytes_per_token or info.bytes_per_token  # what a fetch moves (codec)
        self.eos_ids = list(info.eos_token_ids)
        self._namespace = parse_namespace_hex(info.namespace)
        self.tenants.learn(info.namespace_doc)
        log.info("router serves %s (context %d, chunks of %d tokens)", info.model_id, self.max_positions,
                 self.chunk_tokens)

    def _on_load(self, state: WorkerState) -> None:
        if state.load is not None and (state.load.decode_token_ms > 0 or state.load.decode_step_ms > 0):
            self.cost.observe_decode(state.load.decode_token_ms / 1e3, state.load.decode_step_ms / 1e3)

    @property
    def model_name(self) -> str | None:
        return self.config.model_name or (self.workers.model_id if self.workers else None)

    def ready(self) -> bool:
        return self.tokenizer is not None and any(s.role in ("decode", "both") for s in self.workers.serving())

    # -- routing -------------------------------------------------------------------------------
    def not_serving(self, tenant: str | None) -> tuple[str, ...]:
        """Workers that do not serve `tenant` (their keyring lacks it: `WorkerInfo.tenants`)."""
        if tenant is None or self.workers is None:
            return ()
        return tuple(s.name for s in self.workers.serving()
                     if s.info.tenants is not None and tenant not in s.info.tenants)

    def snapshot(self, keys: list[str], exclude: tuple[str, ...] = ()) -> Snapshot:
        views = tuple(s.view(keys) for s in self.workers.serving())
        snap = Snapshot(views, self.cost.params(), self.targets)
        return without_workers(snap, exclude) if exclude else snap

    def _headers(self, tenant: Tenant | None) -> dict[str, str]:
        return {**_JSON, TENANT_HEADER: tenant.id} if tenant is not None and self.backend is None else _JSON

    async def route(self, ids: list[int], max_tokens: int, tenant: Tenant | None = None,
                    u32: bytes | None = None) -> tuple[Decision, RouteRequest, list[str]]:
        """`u32`: the same ids as little-endian u32 bytes (`RouterTokenizer.encode_prompt`), if at
        hand: the chunk keys are hashed from them without converting `ids` again."""
        namespace = self._namespace if tenant is None else tenant.namespace  # tenants.py
        if not namespace:
            keys = []
        elif u32 is not None:
            keys = chunk_keys_hex_u32(namespace, u32, self.chunk_tokens)
        else:
            keys = chunk_keys_hex(namespace, ids, self.chunk_tokens)
        pool_chunks = 0
        if keys and self.config.pool and (tenant is not None or self.pool is not None):
            try:
                if tenant is None:
                    pool_chunks = await self.pool.match(keys)
                else:
                    pool_chunks = await (await self.tenants.pool(tenant)).match_prefix(keys)
            except KVPoolError as exc:  # a pool outage costs reuse, not the request
                log.warning("match_prefix failed, routing as if nothing were cached: %s", exc)
        self._seq += 1
        req = RouteRequest(seq=self._seq, prompt_tokens=len(ids), max_tokens=max_tokens,
                           chunk_tokens=self.chunk_tokens or 1, pool_prefix_chunks=pool_chunks,
                           bytes_per_token=self.bytes_per_token)
        exclude = self.not_serving(tenant.id if tenant is not None else None)
        snap = self.snapshot(keys, exclude)
        if exclude and not any(w.decodes for w in snap.workers):
            raise Unavailable(f"no worker serves tenant {tenant.id}: the workers' keyrings hold other tenants")
        return self.policy.choose(req, snap), req, keys

    # -- execution -----------------------------------------------------------------------------
    async def generate(self, ids: list[int], max_tokens: int, sampling: wire.SamplingParams,
                       out: Outcome, request_id: str, entry: Entry | None = None,
                       u32: bytes | None = None) -> AsyncIterator[Piece]:
        """Route and run one request (for the tenant of keyring `entry`, if given); yields text
        pieces, the last with its finish reason. `u32`: as for `route`.

        Raises `OpenAIError`-mappable `KVPoolError`s before the first piece (429 reject, 503 no
        worker); after it, a failure raises too and the HTTP layer ends the stream with an error."""
        started = time.perf_counter()
        tenant = self.tenants.of(entry)
        headers = self._headers(tenant)
        decision, req, keys = await self.route(ids, max_tokens, tenant, u32)
        out.route_s = time.perf_counter() - started
        out.prompt_tokens, out.decision = len(ids), decision
        counted = False

        def count() -> None:  # the route's metrics: once, after the first piece (off TTFT) at the latest
            nonlocal counted
            if not counted:
                counted = True
                self.metrics.route.observe(out.route_s)
                self.metrics.decisions.labels(policy=self.policy.name, kind=decision.kind).inc()

        if decision.kind == "unavailable":
            count()
            raise Unavailable(decision.reject)
        if decision.reject is not None:
            count()
            self.metrics.rejected.inc()
            raise Rejected(decision.reject, decision)
        excluded: list[str] = list(self.not_serving(tenant.id if tenant is not None else None))
        try:
            for attempt in range(2):
                try:
                    if self.backend is not None:
                        stream = self.backend.run(self, decision, ids, max_tokens, sampling, out, request_id,
                                                  tenant)
                    elif decision.prefill is None:
                        stream = self._colocated(decision, ids, max_tokens, sampling, out, request_id, headers)
                    else:
                        stream = self._disaggregated(decision, keys, req, ids, max_tokens, sampling, out,
                                                     request_id, headers)
                    async for piece in stream:
                        yield piece
                        count()
                    return
                except _BeforeFirst as exc:  # nothing reached the client yet: try once elsewhere
                    excluded.append(exc.worker)
                    if attempt == 1:
                        raise exc.error from None
                    self.metrics.retries.labels(stage="route").inc()
                    count()
                    decision = self.policy.choose(req, self.snapshot(keys, tuple(excluded)))
                    out.decision = decision
                    if decision.reject is not None or decision.decode is None:
                        raise exc.error from None
                    log.warning("request %s: retrying on %s after %s", request_id, decision.decode, exc.error)
        finally:
            count()

    async def _colocated(self, d: Decision, ids: list[int], max_tokens: int, sampling: wire.SamplingParams,
                         out: Outcome, rid: str, headers: dict[str, str]) -> AsyncIterator[Piece]:
        worker = self.workers.by_name(d.decode)
        msg = wire.GenerateRequest(token_ids=ids, max_tokens=max_tokens, request_id=rid, sampling=sampling)
        uncached = len(ids) - d.cached_tokens
        worker.prefill_sent(uncached)
        worker.decode_sent()
        prefilled = True
        try:
            async for event in self._stream(worker, "/v1/generate", msg, headers, before_first=True):
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
                        self._learn(head, worker, None)
        finally:
            worker.decode_done()
            if prefilled:
                worker.prefill_done(uncached)

    async def _disaggregated(self, d: Decision, keys: list[str], req: RouteRequest, ids: list[int],
                             max_tokens: int, sampling: wire.SamplingParams, out: Outcome,
                             rid: str, headers: dict[str, str]) -> AsyncIterator[Piece]:
        p = self.workers.by_name(d.prefill)
        head, round_trip = await self._prefill(p, ids, d, sampling, rid, headers)
        out.cached_tokens = head.cached_tokens
        out.completion_tokens = 1
        try:
            yield Piece(head.text)
        finally:  # the first token is on its way to the client before the router learns from it
            self._learn(head, p, round_trip)
        msg = wire.DecodeRequest(handle=head.handle, first_token=head.first_token, max_tokens=max_tokens,
                                 sampling=sampling)
        tried: list[str] = [p.name] if p.role == "prefill" else []
        tried += self.not_serving(headers.get(TENANT_HEADER))
        decoder = self.workers.by_name(d.decode)
        lost: KVPoolError | None = None
        for attempt in range(2):
            decoder.decode_sent()
            try:
                async for event in self._stream(decoder, "/v1/decode", msg, headers, before_first=True):
                    if event.done:
                        yield Piece(finish=event.finish_reason or "stop")
                        return
                    out.completion_tokens += 1
                    yield Piece(event.text)
                return
            except (KeyNotFound, CorruptObject) as exc:  # the worker says the handle's KV is gone
                lost = exc
                break
            except _BeforeFirst as exc:  # the handle still names the KV in the pool: another decoder
                tried.append(decoder.name)
                if isinstance(exc.error, (KeyNotFound, CorruptObject)):
                    lost = exc.error
                    break
                if attempt == 1 or isinstance(exc.error, InvalidArgument):
                    raise exc.error from None
                snap = self.snapshot(keys, tuple(tried))
                alt = [w for w in snap.workers if w.decodes]
                if not alt:
                    raise exc.error from None
                best = min(alt, key=lambda w: (tbt_estimate(w, snap.cost), w.name))
                self.metrics.retries.labels(stage="decode").inc()
                log.warning("request %s: decode retried on %s after %s", rid, best.name, exc.error)
                decoder = self.workers.by_name(best.name)
            finally:
                decoder.decode_done()
        if lost is not None:  # recompute on the decode worker: prompt + first token, the rest of the budget
            if max_tokens < 2:  # (a decode worker loads nothing for a one-token budget: not reached)
                raise lost
            self.metrics.retries.labels(stage="kv_lost").inc()
            log.warning("request %s: %s; %s generates the rest from the prompt", rid, lost, decoder.name)
            again = Decision(prefill=None, decode=decoder.name, kind="local_prefill")
            try:
                async for piece in self._colocated(again, [*ids, head.first_token], max_tokens - 1, sampling,
                                                   out, rid, headers):
                    yield piece
            except _BeforeFirst as exc:  # the first token already reached the client: no retry elsewhere
                raise exc.error from None

    async def _prefill(self, p: WorkerState, ids: list[int], d: Decision, sampling: wire.SamplingParams,
                       rid: str, headers: dict[str, str]) -> tuple[wire.PrefillResponse, float]:
        """The worker's answer, and the call's round trip in seconds."""
        uncached = len(ids) - d.cached_tokens
        p.prefill_sent(uncached)
        sent = time.perf_counter()
        try:
            body = await self._post(p, "/v1/prefill", wire.PrefillRequest(token_ids=ids, request_id=rid,
                                                                          sampling=sampling), headers)
            round_trip = time.perf_counter() - sent
            head = wire.decode(body, wire.PrefillResponse)
        finally:
            p.prefill_done(uncached)
        return head, round_trip

    def _learn(self, head: wire.PrefillResponse, worker: WorkerState, round_trip_s: float | None) -> None:
        """Feed the cost model (and refit it now, so that the next route finds it fitted) and the
        token counters. Called once the first token is on its way: none of this is on TTFT."""
        fetched = head.pool_cached_tokens * (worker.info.stored_bytes_per_token or worker.info.bytes_per_token
                                             or self.bytes_per_token)
        self.cost.observe_prefill(head.computed_tokens, head.cached_tokens, head.compute_ms / 1e3,
                                  fetched, head.fetch_ms / 1e3)
        if worker.role == "prefill" and round_trip_s is not None:  # the push plus the HTTP round trip
            http = round_trip_s - head.prefill_ms / 1e3  # (queue wait is not hand-off)
            self.cost.observe_handoff(max(0.0, head.push_ms / 1e3 + http))
        self.metrics.prompt_tokens.labels(source="cached").inc(head.cached_tokens)
        self.metrics.prompt_tokens.labels(source="computed").inc(head.computed_tokens)
        self.cost.params()

    # -- introspection -------------------------------------------------------------------------
    def _pressure(self) -> dict[str, float]:
        if self.workers is None:
            return {}
        snap = self.snapshot([])
        probe = RouteRequest(seq=0, prompt_tokens=1, max_tokens=1, chunk_tokens=max(1, self.chunk_tokens),
                             pool_prefix_chunks=0, bytes_per_token=self.bytes_per_token)
        prefillers = [w for w in snap.workers if w.prefills]
        decoders = [w for w in snap.workers if w.decodes]
        out = {}
        if prefillers:
            wait = min(prefill_estimate(probe, w, snap.cost) for w in prefillers)
            out["prefill"] = wait / (self.targets.ttft_s or 2.0)
        if decoders:
            tbt = min(tbt_estimate(w, snap.cost) for w in decoders)
            out["decode"] = tbt / (self.targets.tbt_s or 0.2)
        return out

    def _worker_counts(self) -> dict[tuple[str, str], int]:
        counts: dict[tuple[str, str], int] = {}
        for s in (self.workers.by_url.values() if self.workers else ()):
            counts[(s.role, s.status)] = counts.get((s.role, s.status), 0) + 1
        return counts


_JSON = {"content-type": "application/json"}


class Rejected(KVPoolError):
    """Admission refused the request: no choice meets the targets (HTTP 429)."""

    code = "rejected"
    http_status = 429

    def __init__(self, message: str, decision: Decision):
        super().__init__(message)
        self.decision = decision


__all__ = ["Router", "RouterConfig", "Piece", "Outcome", "Rejected", "DOWN", "DRAINING", "UP"]
