"""A reference worker: the model, its local prefix cache, the pool, and the engine, behind the
three operations the HTTP API exposes (prefill, decode, generate).

Prefill of a prompt of n tokens:
  1. chunk keys of its full chunks; the longest run held in the local cache (k_local chunks);
  2. the longest run in the pool (one match_prefix, unless the router sent the one it made when
     it routed the prompt: `pool_chunks`); chunks the pool has beyond k_local are fetched,
     verified and added to the local cache (a missing or damaged one ends the run: recomputed);
  3. the engine computes only tokens [cached, n) on a cache built from those chunks (at
     least the last token, so a fully cached prompt still yields its logits);
  4. the new full chunks enter the local cache; every full chunk the pool lacks (new, or local
     only) and the tail are pushed through the adapter; a KV handle names them.
Decode of a handle: the chunks come from the local cache where it has them, the rest and the tail
from the pool (all or nothing); the sequence joins the running batch; the tail is released when
the sequence ends.

Tenants (`tenants.py`): every prefill/decode/generate runs as the tenant the router names (the
`tenant` argument, from `X-KVPool-Tenant`), in that tenant's namespace, on its pool principal,
with its chunk MAC key; prefill signs the handle for that tenant and decode refuses, before any
side effect, a handle without token ids, of another namespace or tenant, or with a bad signature
(`KVHandle.verify`, `ChunkStore.check_handle`), so `release=true` removes only the tail a valid
handle names. Without a keyring there is one untenanted namespace, as before.

Draining (SIGTERM, see `server.py`): new prefill/decode/generate calls get `Unavailable`; the
process exits once `idle()`: nothing accepted is in flight (`admission.py`), nothing in the engine.

Invariants:
- KV bytes never pass through the HTTP layer: a handle names pool objects only.
- Only the engine thread runs the model; fetches and pushes run in other threads and
  never touch a cache after it has been submitted.
- A chunk whose check fails is a miss (recomputed), never KV.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator

from kvpool.handle import KVHandle
from reference_worker import sampling
from reference_worker.admission import Admission
from reference_worker.config import NO_POOL, WorkerConfig
from reference_worker.detokenizer import Detokenizer
from reference_worker.events import EventLog
from kvpool.worker_api import (DecodeRequest, GenerateRequest, LoadReport, PrefillRequest,
                                              PrefillResponse, SamplingParams, TokenEvent, TokenizeRequest,
                                              TokenizerInfo, WorkerInfo, error_event)
from reference_worker.metrics import WorkerMetrics, prompt_sources
from reference_worker.prefix_cache import LocalPrefixCache
from reference_worker.engine import Engine
from reference_worker.kv_cache import SequenceKV
from reference_worker.model_runner import ModelRunner
from reference_worker.scheduler import Scheduler
from reference_worker.sequence import DecodeSequence, PrefillJob
from reference_worker.tenants import Tenants, TenantKV
from kvpool.codec import stored_bytes_per_token
from kvpool.errors import InvalidArgument, KVPoolError

log = logging.getLogger(__name__)


@dataclass
class _Prefix:
    """What prefill found before computing: the chunks and where they came from."""

    keys: list[str]
    chunks: list[Any]
    local_chunks: int
    pool_chunks: int
    fetch_ms: float = 0.0  # matching and reading the pool's part of the prefix
    pool_tiers: list[str] = field(default_factory=list)  # per pool chunk, the tier that served it


class Worker:
    def __init__(self, config: WorkerConfig, model: Any, pool: Any, *, keyring: Any = None,
                 connect: Any = None):
        """`pool`: the client of untenanted requests; `keyring` (a `kvpool.security.keyring.Keyring`): serve
        tenants (`tenants.py`), each on a pool client `connect(credential)` makes (default
        `kvpool.connect(config.pool, credential=...)`)."""
        self.config = config
        self.rm = model  # reference_worker.model.ReferenceModel
        self.pool = pool
        self.pooled = config.pool != NO_POOL  # else nothing is read from or written to a pool
        namespace = model.namespace(config.chunk_tokens, config.tenant_salt)
        self.namespace = replace(namespace, layout=replace(namespace.layout, codec=config.kv_codec))
        self.layout = self.namespace.layout
        self.cache = LocalPrefixCache(config.local_cache_bytes)  # keys are per namespace: tenants never share one
        self.events = EventLog()
        self.cache.add_listener(lambda ev: self.events.append(ev.kind, ev.keys, "local"))
        self.tenants = Tenants(model.model, self.namespace, pool, keyring,
                               on_adapter=lambda ad: ad.add_listener(lambda ev: self.events.append(ev.kind, ev.keys, "pool")),
                               connect=connect or self._connect)
        self.adapter = self.tenants.default.adapter  # untenanted requests' adapter
        self.reader = self.adapter.store.reader  # the adapters' one chunk reader, and its rule for damage
        self.eos = frozenset(model.eos_token_ids)
        self.metrics = WorkerMetrics(config.role, self)
        self.runner = ModelRunner(model.model)
        self.engine = Engine(self.runner, Scheduler(max_batch=config.max_batch, max_kv_tokens=config.max_kv_tokens,
                                                    prefill_chunk_tokens=config.prefill_chunk_tokens),
                             on_step=self._on_step)
        self.admission = Admission()
        self._unsubmitted_tokens = 0  # prompt tokens accepted but not yet handed to the engine
        self._tokenizer_info: TokenizerInfo | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, warmup: bool = True) -> "Worker":
        if warmup:  # the first forward of a process is several times slower; pay it before serving
            started = time.perf_counter()
            kvs = [self.runner.new_kv(66) for _ in range(4)]
            self.runner.step([(kvs[0], list(range(1, 65)))])
            for kv in kvs[1:]:
                kv.data[:, :, :, :64] = kvs[0].data[:, :, :, :64]
                kv.length = 64
            for batch in (1, 4):  # two batch sizes: the first estimate of a decode step's cost line
                seconds = time.perf_counter()
                self.runner.step([(kv, [1]) for kv in kvs[:batch]])
                self.engine.decode_cost.observe(batch, time.perf_counter() - seconds)
            log.info("warm-up forwards took %.2f s", time.perf_counter() - started)
        self.engine.start()
        return self

    def stop(self) -> None:
        self.engine.stop()
        self.tenants.close()

    def _connect(self, credential: Any) -> Any:
        import kvpool

        return kvpool.connect(self.config.pool, credential=credential)

    @property
    def damaged_chunks(self) -> int:
        """Chunks that failed verification, over every tenant's reader."""
        return sum(kv.reader.damaged for kv in self.tenants.all())

    def start_drain(self) -> None:
        """Refuse new prefill/decode/generate calls from now on; what was accepted runs to its end."""
        self.admission.drain()
        log.info("draining: %d requests and streams in flight", self.admission.in_flight)

    def idle(self) -> bool:
        return self.admission.in_flight == 0 and not self.engine.busy

    def wait_idle(self, timeout: float, poll_s: float = 0.05) -> bool:
        """Block (not on the event loop) until `idle()`, or `timeout` seconds; True when idle."""
        deadline = time.monotonic() + timeout
        while not self.idle():
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)
        return True

    def _on_step(self, batch: int, prefill_tokens: int, seconds: float) -> None:  # engine thread
        if batch:  # a step with decode tokens counts as a decode step, prefill chunk or not
            self.metrics.decode_step(batch, seconds)
        else:
            self.metrics.prefill_chunk(prefill_tokens, seconds)

    # -- small queries -------------------------------------------------------------------------
    def info(self) -> WorkerInfo:
        return WorkerInfo(role=self.config.role, model_id=self.rm.model_id, namespace=self.namespace.hex(),
                          chunk_tokens=self.layout.chunk_tokens, dtype=self.layout.dtype, pool=self.config.pool,
                          eos_token_ids=sorted(self.eos), max_positions=self.runner.max_positions,
                          bytes_per_token=self.layout.bytes_per_token, kv_codec=self.layout.codec,
                          stored_bytes_per_token=stored_bytes_per_token(self.layout),
                          namespace_doc=self.namespace.canonical_json(),
                          tenants=self.tenants.keyring.tenant_ids() if self.tenants.keyring is not None else None)

    def load(self) -> LoadReport:
        per_token = self.layout.bytes_per_token
        step_s, seq_s = self.engine.decode_cost.fit()
        return LoadReport(role=self.config.role, queue_length=self.engine.queue_length,
                          active_sequences=self.engine.active_sequences, kv_tokens=self.engine.kv_tokens(),
                          cache_tokens=self.cache.tokens, cache_capacity_tokens=self.cache.capacity_bytes // per_token,
                          max_batch=self.config.max_batch,
                          prefill_queue_tokens=self._unsubmitted_tokens + self.engine.prefill_tokens(),
                          decode_token_ms=round(seq_s * 1e3, 3), decode_step_ms=round(step_s * 1e3, 3),
                          open_streams=self.admission.open_streams, draining=self.admission.draining)

    def tokenizer_info(self) -> TokenizerInfo:
        """The tokenizer as data (see `TokenizerInfo` for how a router renders and encodes with it)."""
        if self._tokenizer_info is None:
            from tokenizers import Tokenizer

            tok = self.rm.tokenizer
            tokenizer_json = tok.backend_tokenizer.to_str()
            # Plain encoding is `tokenizer(text)`; if it ever starts with a BOS that the JSON's own
            # post-processor does not add, a router must prepend it: probe instead of trusting flags.
            probe = "Hello, world"
            plain, bare = self.rm.encode(probe), Tokenizer.from_str(tokenizer_json).encode(probe).ids
            add_bos = tok.bos_token_id is not None and plain == [tok.bos_token_id, *bare]
            if plain != bare and not add_bos:
                log.warning("plain encoding differs from the tokenizer JSON's: %s vs %s", plain, bare)
            self._tokenizer_info = TokenizerInfo(
                model_id=self.rm.model_id, tokenizer_json=tokenizer_json, chat_template=tok.chat_template,
                bos_token=tok.bos_token, eos_token=tok.eos_token, add_bos_token=add_bos,
                special_tokens={k: v for k, v in tok.special_tokens_map.items() if isinstance(v, str)})
        return self._tokenizer_info

    def tokenize(self, req: TokenizeRequest) -> list[int]:
        if (req.prompt is None) == (req.messages is None):
            raise InvalidArgument("give exactly one of 'prompt' or 'messages'")
        if req.prompt is not None:
            ids = self.rm.encode(req.prompt)
        else:
            try:
                ids = self.rm.encode_chat([{"role": m.role, "content": m.content} for m in req.messages])
            except ValueError as exc:  # the chat template refused the conversation: the caller's input
                raise InvalidArgument(f"the chat template refused the conversation: {exc}") from None
        return self._check_tokens(ids)

    def _check_tokens(self, ids: list[int]) -> list[int]:
        if not ids:
            raise InvalidArgument("the prompt has no tokens")
        vocab = self.runner.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidArgument(f"token id {bad} is outside the vocabulary 0..{vocab - 1}")
        if len(ids) >= self.runner.max_positions:
            raise InvalidArgument(f"the prompt has {len(ids)} tokens; this model takes at most "
                                  f"{self.runner.max_positions - 1}")
        return ids

    def _require(self, *roles: str) -> None:
        if self.config.role not in roles:
            raise InvalidArgument(f"this is a {self.config.role} worker; that call needs role {' or '.join(roles)}")

    # -- prefill -------------------------------------------------------------------------------
    def _find_prefix(self, kv: TenantKV, ids: list[int], pool_chunks: int | None = None) -> _Prefix:
        """`pool_chunks`: the router's count of the prompt's chunks in the pool (None: ask it)."""
        keys = kv.adapter.chunk_keys(ids)
        local = self.cache.get_run(keys)
        fetched: list[Any] = []
        tiers: list[str] = []
        fetch_ms = 0.0
        if len(local) < len(keys):
            started = time.perf_counter()
            in_pool = (0 if not self.pooled else kv.reader.match(keys) if pool_chunks is None
                       else min(pool_chunks, len(keys)))
            if in_pool > len(local):
                views = kv.reader.run(keys[len(local):in_pool])
                fetched = [view.as_torch() for view in views]
                tiers = [view.tier for view in views]
            fetch_ms = (time.perf_counter() - started) * 1e3
            if fetched:
                self.cache.put_many(zip(keys[len(local):], fetched))
        return _Prefix(keys, local + fetched, len(local), len(fetched), fetch_ms, tiers)

    async def run_prefill(self, ids: list[int], request_id: str, params: SamplingParams | None = None,
                          kv: TenantKV | None = None, room: int = 0,
                          pool_chunks: int | None = None) -> tuple[PrefillJob, _Prefix]:
        """Find the cached prefix, compute the rest; the job holds the KV (with space for `room`
        more tokens: what a decode on it will add), the last logits and the first token (picked
        per `params`). `pool_chunks`: the router's match (`PrefillRequest.pool_chunks`)."""
        self._unsubmitted_tokens += len(ids)  # event loop only: no lock
        try:
            prefix = await asyncio.to_thread(self._find_prefix, kv or self.tenants.default, ids, pool_chunks)
            cached = len(prefix.chunks) * self.layout.chunk_tokens
            usable = min(cached, len(ids) - 1)  # compute at least one token: its logits give the first token
            capacity = min(len(ids) + room, self.runner.max_positions)
            cache = (await asyncio.to_thread(SequenceKV.from_chunks, prefix.chunks, usable, capacity) if usable
                     else self.runner.new_kv(capacity))
            job = PrefillJob(request_id, ids, cache, sampling=params)
            self.engine.submit_prefill(job)
        finally:
            self._unsubmitted_tokens -= len(ids)
        await asyncio.wrap_future(job.future)
        return job, prefix

    def _publish(self, kv: TenantKV, ids: list[int], job: PrefillJob, prefix: _Prefix, request_id: str | None) -> Any:
        """New full chunks into the local cache; missing chunks (and the tail) into the pool."""
        c = self.layout.chunk_tokens
        full = len(ids) // c
        have = len(prefix.chunks)
        if full > have and self.cache.capacity_bytes > 0:  # (a disabled cache would drop the copies)
            self.cache.put_many(zip(prefix.keys[have:full], job.kv.chunks(have, full, c)))
        if not self.pooled:
            return None
        return kv.adapter.save(ids, job.kv.layers(len(ids)), request_id=request_id, start_token=0)

    async def prefill(self, req: PrefillRequest, tenant: str | None = None) -> PrefillResponse:
        self._require("prefill", "both")
        started = time.perf_counter()
        ids = self._check_tokens(list(req.token_ids))
        params = sampling.check(req.sampling)
        rid = _unique(req.request_id)
        with self.admission.request():
            kv = await asyncio.to_thread(self.tenants.get, tenant)
            job, prefix = await self.run_prefill(ids, rid, params, kv, pool_chunks=req.pool_chunks)
            pushed = time.perf_counter()
            saved = await asyncio.to_thread(self._publish, kv, ids, job, prefix, rid)
            handle = kv.adapter.make_handle(ids, saved)
            if kv.handle_key is not None:  # with a keyring: only this tenant's decode workers accept it
                handle = handle.signed(kv.handle_key, kv.tenant)
            head = self._prefill_response(rid, ids, job, prefix, handle, started, kv.tenant)
            head.push_ms = round((time.perf_counter() - pushed) * 1e3, 3)
            return head

    def _prefill_response(self, rid: str, ids: list[int], job: PrefillJob, prefix: _Prefix,
                          handle: KVHandle | None, started: float, tenant: str | None = None) -> PrefillResponse:
        c = self.layout.chunk_tokens
        first = int(job.future.result())
        computed = job.computed_tokens
        tokens, chunks = prompt_sources(c, len(ids), computed, len(prefix.keys), prefix.local_chunks,
                                        prefix.pool_tiers)
        local_tokens = tokens["worker"]
        ssd_tokens = tokens["pool_ssd"]
        pool_tokens = tokens["pool_dram"] + ssd_tokens
        elapsed_ms = (time.perf_counter() - started) * 1e3
        self.metrics.prefill_done(tokens, chunks, elapsed_ms / 1e3, tenant)
        log.info("prefill %s: %d tokens, %d local + %d pool (%d from SSD) cached, %d computed, %.0f ms",
                 rid, len(ids), local_tokens, pool_tokens, ssd_tokens, computed, elapsed_ms)
        dummy = handle or KVHandle(namespace=self.namespace.hex(), request_id=rid, num_tokens=0,
                                   chunk_tokens=c, chunk_keys=[])
        return PrefillResponse(request_id=rid, first_token=first, handle=dummy, prompt_tokens=len(ids),
                               cached_tokens=local_tokens + pool_tokens, local_cached_tokens=local_tokens,
                               pool_cached_tokens=pool_tokens, computed_tokens=computed, pool_ssd_tokens=ssd_tokens,
                               prefill_ms=round(elapsed_ms, 3), text=self.rm.decode([first]),
                               fetch_ms=round(prefix.fetch_ms, 3), compute_ms=round(job.compute_s * 1e3, 3))

    # -- decode --------------------------------------------------------------------------------
    def _load_handle(self, kv: TenantKV, handle: KVHandle, room: int) -> SequenceKV:
        keys = list(handle.chunk_keys)
        local = self.cache.get_run(keys)
        fetched = [view.as_torch() for view in kv.adapter.store.fetch_handle(handle, skip=len(local))]
        self.cache.put_many(zip(keys[len(local):], fetched))
        self.metrics.decode_loaded(len(local) * self.layout.chunk_tokens,
                                   handle.num_tokens - len(local) * self.layout.chunk_tokens)
        capacity = min(handle.num_tokens + room, self.runner.max_positions)
        return SequenceKV.from_chunks(local + fetched, handle.num_tokens, capacity)

    def _release(self, kv: TenantKV, handle: KVHandle, verified: bool = False) -> None:
        try:
            kv.adapter.store.release_handle(handle, verified=verified)
        except KVPoolError as exc:  # the tail's lease reclaims it anyway
            log.warning("could not release the tail of %s: %s", handle.request_id, exc)

    async def open_decode(self, req: DecodeRequest, tenant: str | None = None) -> AsyncIterator[TokenEvent]:
        """Validate, load the KV and join the batch; the returned iterator streams the tokens.

        Errors before the stream starts (bad handle, KV gone) raise here, so the HTTP layer can
        answer with a status code; later errors end the stream with an error line. The handle is
        checked before any side effect (a refused handle releases nothing).
        """
        self._require("decode", "both")
        kv = await asyncio.to_thread(self.tenants.get, tenant)
        handle = req.handle.validate().verify(kv.handle_key, kv.tenant)
        if handle.num_tokens <= 0:
            raise InvalidArgument("the KV handle covers no tokens")
        kv.adapter.store.check_handle(handle)  # token ids required; keys and tail re-derived from them
        self._check_tokens([req.first_token])
        params = sampling.check(req.sampling)
        rid = handle.request_id or uuid.uuid4().hex
        stop = frozenset(req.stop_token_ids) if req.stop_token_ids is not None else self.eos
        # Before any side effect: a draining worker refuses and leaves the tail for another decoder.
        slot = self.admission.open_stream()
        try:
            if req.first_token in stop or req.max_tokens == 1:
                if req.release:
                    await asyncio.to_thread(self._release, kv, handle)
                reason = "stop" if req.first_token in stop else "length"
                done = TokenEvent(request_id=rid, done=True, finish_reason=reason)
                return self.admission.watch(_single(done), slot)
            try:
                cache = await asyncio.to_thread(self._load_handle, kv, handle, req.max_tokens)
            except BaseException:
                if req.release:
                    await asyncio.to_thread(self._release, kv, handle)
                raise
        except BaseException:
            slot.release()
            raise
        on_done = (lambda: self._release(kv, handle, verified=True)) if req.release else None  # loaded: verified
        events = self._stream(rid, cache, req.first_token, req.max_tokens - 1, stop, params, on_done)
        return self.admission.watch(events, slot)

    async def _stream(self, rid: str, cache: SequenceKV, first: int, budget: int, stop: frozenset[int],
                      params: SamplingParams | None, on_done: Any = None) -> AsyncIterator[TokenEvent]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(token, reason, error):  # engine thread -> event loop
            loop.call_soon_threadsafe(queue.put_nowait, (token, reason, error))

        seq = DecodeSequence(rid, cache, first, budget, stop, emit, sampling=params)
        detok = Detokenizer(self.rm.tokenizer, [first])
        started = last = time.perf_counter()
        index = 0
        finished = False
        try:
            self.engine.submit_decode(seq)
            while True:
                token, reason, error = await queue.get()
                if error is not None:
                    finished = True
                    yield error_event(rid, error)
                    return
                if token is not None:
                    index += 1
                    now = time.perf_counter()
                    self.metrics.token_out(now - last)
                    last = now
                    yield TokenEvent(request_id=rid, index=index, token_id=token, text=detok.push(token))
                if reason is not None:
                    finished = True
                    self.metrics.decode_done(index, time.perf_counter() - started)
                    yield TokenEvent(request_id=rid, done=True, finish_reason=reason)
                    return
        finally:
            if not finished:  # the client went away: leave the batch at the next step
                seq.cancelled = True
                self.engine.wake()
            if on_done is not None:
                await asyncio.to_thread(on_done)

    # -- generate: prefill and decode here, no pool round trip ----------------------------------
    async def open_generate(self, req: GenerateRequest, tenant: str | None = None) -> AsyncIterator[TokenEvent]:
        """Role `both`, and `decode` (a router's short uncached prompts). The stream counts as open
        from acceptance, its prefill included."""
        self._require("decode", "both")
        started = time.perf_counter()
        ids = self._check_tokens(list(req.token_ids))
        params = sampling.check(req.sampling)
        rid = _unique(req.request_id)
        slot = self.admission.open_stream()
        try:
            kv = await asyncio.to_thread(self.tenants.get, tenant)
            job, prefix = await self.run_prefill(ids, rid, params, kv, room=req.max_tokens,
                                                 pool_chunks=req.pool_chunks)
            head = self._prefill_response(rid, ids, job, prefix, None, started, kv.tenant)
        except BaseException:
            slot.release()
            raise
        # Full chunks still go to the local cache and the pool (prefix reuse), off the first
        # token's path (no tail, no handle: nobody waits for them). The prompt's KV is final: the
        # decode below only appends after it.
        publish = asyncio.ensure_future(asyncio.to_thread(self._publish, kv, ids, job, prefix, None))
        publish.add_done_callback(_log_failed_publish)
        stop = frozenset(req.stop_token_ids) if req.stop_token_ids is not None else self.eos
        return self.admission.watch(self._generate_stream(head, job, req.max_tokens, stop, params, publish), slot)

    async def _generate_stream(self, head: PrefillResponse, job: PrefillJob, max_tokens: int, stop: frozenset[int],
                               params: SamplingParams | None, publish: asyncio.Future) -> AsyncIterator[TokenEvent]:
        rid, first = head.request_id, head.first_token
        try:
            yield TokenEvent(request_id=rid, index=0, token_id=first, text=head.text, prefill=head)
            if first in stop or max_tokens == 1:
                yield TokenEvent(request_id=rid, done=True, finish_reason="stop" if first in stop else "length")
                return
            events = self._stream(rid, job.kv, first, max_tokens - 1, stop, params)
            try:
                async for event in events:
                    yield event
            finally:  # closing this stream closes the decode under it now, not at garbage collection
                await events.aclose()
        finally:  # the stream (and its admission slot) ends once its KV is stored: a drain waits for it
            await asyncio.wait([publish])


def _log_failed_publish(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("storing a prompt's KV failed (it is served, not cached): %s", task.exception())


def _unique(request_id: str | None) -> str:
    """The caller's request id plus a unique suffix: the tail object `tail/<id>` is first-writer-
    wins, so a reused caller id must never name another prompt's tail."""
    suffix = uuid.uuid4().hex[:12]
    if not request_id:
        return uuid.uuid4().hex
    if "/" in request_id or len(request_id) > 200:
        raise InvalidArgument("request_id must have at most 200 characters and no '/'")
    return f"{request_id}.{suffix}"


async def _single(event: TokenEvent) -> AsyncIterator[TokenEvent]:
    yield event
