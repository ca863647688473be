"""The router: one request from token ids to a stream of text pieces, through the chosen workers.

    route:    chunk keys of the prompt -> one match_prefix to the pool -> a snapshot of the
              workers (load, what each holds locally) -> the policy's decision
    execute:  the backend of the workers' API runs the decision (backends/: a prefill worker
              then a decode worker, or one worker that does both; its own retries and recovery)
    retry:    a worker that cannot be reached, or fails before anything was streamed, is taken
              out of rotation and the request is routed once more without it. After the first
              token is sent, a failure ends the stream with an error.

Tenants (with a keyring whose tenants have `api_keys`, see app.py and tenants.py): a request
runs as the tenant its API key names: its chunk keys are in that tenant's salted namespace,
`match_prefix` asks the pool as its principal, and the backend names the tenant to the worker
(reference workers: `X-KVPool-Tenant`; vLLM: the tenant's cache_salt).

Invariants: the router never holds KV bytes (handles name pool objects); every request it
counts in flight on a worker (`inflight_*`) is uncounted exactly once, however it ends; the
cost model only learns from successful prefills.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable, Sequence

from kvpool import worker_api as wire
from kvpool.config import Settings, default
from kvpool.security.keyring import Entry, load_keyring
from kvpool.errors import InvalidArgument, KVPoolError, Unavailable
from kvpool.keys import chunk_keys_hex, chunk_keys_hex_u32, parse_namespace_hex
from kvpool.router.backends import make_backend
from kvpool.router.backends.base import BeforeFirst, Outcome, Piece, Request
from kvpool.router.cost import CostModel
from kvpool.router.kv_events import parse_kv_events
from kvpool.router.matcher import PrefixMatcher
from kvpool.router.metrics import RouterMetrics
from kvpool.router.policy import (Decision, RouteRequest, Snapshot, Targets, make_policy, prefill_estimate,
                                  tbt_estimate, without_workers)
from kvpool.router.tenants import Tenant, Tenants
from kvpool.router.tokenizer import RouterTokenizer
from kvpool.router.backends.vllm import VLLMSettings
from kvpool.router.workers import Workers, WorkerState

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
        vllm = None  # (without a model folder: make_backend says what is missing)
        if r.engine == "vllm" and r.tokenizer:
            vllm = VLLMSettings(model_path=r.tokenizer, connector=dict(r.kv_connector_config), kv_dtype=r.kv_dtype)
        return cls(pool=r.pool, policy=r.policy, workers=list(r.workers),
                   ttft_slo_s=None if r.ttft_slo_ms is None else r.ttft_slo_ms / 1e3,
                   tbt_slo_s=None if r.tbt_slo_ms is None else r.tbt_slo_ms / 1e3,
                   local_prefill_tokens=r.local_prefill_tokens, default_max_tokens=r.default_max_tokens,
                   model_name=r.model_name, engine=r.engine, vllm=vllm, auth_file=settings.security.auth_file,
                   kv_events=list(r.kv_events))


class Router:
    """Routes requests and runs them through `backend`, which calls back `workers`,
    `worker_failed`, `another_decoder` and adds to `metrics` and `cost`."""

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
        self.namespace: bytes | None = None  # the workers' chunk key namespace (untenanted requests)
        self._seq = 0
        self.pool: Any = None  # a PrefixMatcher (matcher.py), or anything with `async match(keys)`
        self.workers: Workers | None = None
        self.metrics = RouterMetrics(self._pressure, self._worker_counts)
        self.keyring = load_keyring(config.auth_file)
        self.backend = make_backend(config.engine, config.vllm, keyring=self.keyring)
        self.kv_events = parse_kv_events(config.kv_events)
        if self.kv_events and not self.backend.kv_events:
            raise InvalidArgument("--kv-events is for vLLM servers (--engine vllm); reference workers send "
                                  "their KV events with their load")
        self._joining: list[asyncio.Task] = []
        self.tenants = Tenants(self.keyring, config.pool, via_cache_salt=not self.backend.tenant_header)
        self._join_lock = asyncio.Lock()
        self._tokenize = ThreadPoolExecutor(max(1, config.tokenize_threads), thread_name_prefix="tokenize")

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> "Router":
        await self.backend.start()
        self.workers = Workers(self.backend, on_join=self._on_join, on_load=self._on_load,
                               kv_events=self.kv_events)
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
                if not self.backend.registers_itself:  # keep asking
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
        await self.backend.close()
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
            if self.tokenizer is not None:
                return
            tok = await self.backend.tokenizer(url)
            self.tokenizer = await asyncio.to_thread(RouterTokenizer.from_info, tok)
            self.max_positions = info.max_positions or 8192
            self.chunk_tokens = info.chunk_tokens
            self.bytes_per_token = info.stored_bytes_per_token or info.bytes_per_token  # what a fetch moves
            self.namespace = parse_namespace_hex(info.namespace)
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

    async def route(self, ids: list[int], max_tokens: int, tenant: Tenant | None = None,
                    u32: bytes | None = None) -> tuple[Decision, RouteRequest, list[str]]:
        """`u32`: the same ids as little-endian u32 bytes (`RouterTokenizer.encode_prompt`), if at
        hand: the chunk keys are hashed from them without converting `ids` again."""
        namespace = self.namespace if tenant is None else tenant.namespace  # tenants.py
        if not namespace:
            keys = []
        elif u32 is not None:
            keys = chunk_keys_hex_u32(namespace, u32, self.chunk_tokens)
        else:
            keys = chunk_keys_hex(namespace, ids, self.chunk_tokens)
        pool_chunks, matched = 0, False
        if keys and self.config.pool and (tenant is not None or self.pool is not None):
            try:
                if tenant is None:
                    pool_chunks = await self.pool.match(keys)
                else:
                    pool_chunks = await (await self.tenants.pool(tenant)).match_prefix(keys)
                matched = True
            except KVPoolError as exc:  # a pool outage costs reuse, not the request
                log.warning("match_prefix failed, routing as if nothing were cached: %s", exc)
        self._seq += 1
        req = RouteRequest(seq=self._seq, prompt_tokens=len(ids), max_tokens=max_tokens,
                           chunk_tokens=self.chunk_tokens or 1, pool_prefix_chunks=pool_chunks,
                           bytes_per_token=self.bytes_per_token, pool_matched=matched)
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
        decision, req, keys = await self.route(ids, max_tokens, tenant, u32)
        out.route_s = time.perf_counter() - started
        out.prompt_tokens, out.decision = len(ids), decision
        kind = decision.kind  # the first decision's, whatever a retry decides
        counted = False

        def count() -> None:  # the route's metrics: once, after the first piece (off TTFT) at the latest
            nonlocal counted
            if not counted:
                counted = True
                self.metrics.route.observe(out.route_s)
                self.metrics.decisions.labels(policy=self.policy.name, kind=kind).inc()

        excluded: list[str] = list(self.not_serving(tenant.id if tenant is not None else None))
        request = Request(ids, max_tokens, sampling, request_id, tenant, keys, req)
        try:
            if decision.kind == "unavailable":
                raise Unavailable(decision.reject)
            if decision.reject is not None:
                self.metrics.rejected.inc()
                raise Rejected(decision.reject, decision)
            for attempt in range(2):
                try:
                    async for piece in self.backend.run(self, decision, request, out):
                        yield piece
                        count()
                    return
                except BeforeFirst as exc:  # nothing reached the client yet: try once elsewhere
                    excluded.append(exc.worker)
                    if attempt == 1:
                        raise exc.error from None
                    self.metrics.retries.labels(stage="route").inc()
                    decision = self.policy.choose(req, self.snapshot(keys, tuple(excluded)))
                    out.decision = decision
                    if decision.reject is not None or decision.decode is None:
                        raise exc.error from None
                    log.warning("request %s: retrying on %s after %s", request_id, decision.decode, exc.error)
        finally:
            count()

    # -- what a backend may ask ------------------------------------------------------------------
    def worker_failed(self, worker: WorkerState, stage: str, why: str) -> None:
        """`worker` could not be reached or broke off during `stage`: counted, out of rotation."""
        self.metrics.worker_failures.labels(stage=stage).inc()
        self.workers.mark_down(worker, why)

    def another_decoder(self, keys: list[str], exclude: Sequence[str], tenant: str | None) -> WorkerState | None:
        """The best decode worker but those in `exclude` (and those that do not serve `tenant`)."""
        snap = self.snapshot(keys, (*exclude, *self.not_serving(tenant)))
        alt = [w for w in snap.workers if w.decodes]
        if not alt:
            return None
        best = min(alt, key=lambda w: (tbt_estimate(w, snap.cost), w.name))
        return self.workers.by_name(best.name)

    # -- introspection -------------------------------------------------------------------------
    def _pressure(self) -> dict[str, float]:
        if self.workers is None:
            return {}
        snap = self.snapshot([])
        probe = RouteRequest(seq=0, prompt_tokens=1, max_tokens=1, chunk_tokens=max(1, self.chunk_tokens),
                             pool_prefix_chunks=0, bytes_per_token=self.bytes_per_token)
        out = {}
        waits = [prefill_estimate(probe, w, snap.cost) for w in snap.workers if w.prefills]
        if waits:
            out["prefill"] = min(waits) / (self.targets.ttft_s or 2.0)
        tbts = [tbt_estimate(w, snap.cost) for w in snap.workers if w.decodes]
        if tbts:
            out["decode"] = min(tbts) / (self.targets.tbt_s or 0.2)
        return out

    def _worker_counts(self) -> dict[tuple[str, str], int]:
        return Counter((s.role, s.status) for s in (self.workers.by_url.values() if self.workers else ()))


class Rejected(KVPoolError):
    """Admission refused the request: no choice meets the targets (HTTP 429)."""

    code = "rejected"
    http_status = 429

    def __init__(self, message: str, decision: Decision):
        super().__init__(message)
        self.decision = decision


__all__ = ["Router", "RouterConfig", "Piece", "Outcome", "Rejected"]
