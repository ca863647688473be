"""The router's view of its workers: who is serving, how loaded, what each holds in its own
prefix cache, and who is leaving.

Workers join by `POST /admin/workers` (a worker started with `--router` does it itself, and
repeats it every few seconds, so a restarted router relearns its workers) or from the command
line (`kvpool router --worker URL`). A poll loop reads each worker's load and its KV events
(tier "local": what entered and left its prefix cache) every `POLL_S`, in one call
(the backend's `poll`: a reference worker answers both in one `GET /load?events_since=N`,
backends/reference.py). Workers whose backend's events come separately (vLLM's OpenAI servers,
backends/vllm.py: their role is given at registration) have a subscriber (kv_events.py) keep
their `local_keys` from their own events, pushed as they happen rather than polled, where the
router knows their KV events endpoint (`kv_events`).

States: `up` (in rotation) -> `draining` (no new requests; forgotten once its load shows no
work and the router has nothing in flight there) ; `up` -> `down` on a refused connection or
`FAIL_AFTER` failed polls in a row, or a failed request (out of rotation at once; back to `up`
when a poll succeeds again; forgotten after `FORGET_S` down).

Invariants: only the event loop thread mutates this registry; a worker whose model or namespace
differs from the router's is refused at registration (409), so every worker in rotation shares
the key space the router hashes prompts into.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from kvpool import worker_api as wire
from kvpool.errors import AlreadyExists, InvalidArgument, Unavailable
from kvpool.router.backends.base import Backend, WorkerRefused
from kvpool.router.kv_events import BlockIndex, KVEventSubscriber, KVEventsSource, namespace_resolver
from kvpool.router.policy import WorkerView

log = logging.getLogger(__name__)

UP, DRAINING, DOWN = "up", "draining", "down"
POLL_S = 0.25  # seconds between two polls of a worker
FAIL_AFTER = 3  # failed polls in a row that take a worker out of rotation
FORGET_S = 30.0  # a worker down this long is forgotten
# What GET /admin/workers shows of a worker's load report.
_SUMMARY_LOAD = ("queue_length", "prefill_queue_tokens", "active_sequences", "kv_tokens", "open_streams",
                 "decode_token_ms", "decode_step_ms", "max_batch")


@dataclass
class WorkerState:
    url: str
    name: str
    info: wire.WorkerInfo
    status: str = UP
    load: wire.LoadReport | None = None
    local_keys: set[str] = field(default_factory=set)
    events_since: int = 0
    failures: int = 0
    down_since: float = 0.0
    # What the router sent and has not seen finish: load reports lag by one poll.
    inflight_prefill_tokens: int = 0
    inflight_prefills: int = 0
    inflight_decodes: int = 0
    served: int = 0
    kv_events: Any = None  # a vLLM instance's KVEventSubscriber (kv_events.py), feeding local_keys

    def prefill_sent(self, tokens: int) -> None:
        """A prefill of `tokens` uncached tokens was sent to this worker (counted until done)."""
        self.inflight_prefill_tokens += tokens
        self.inflight_prefills += 1

    def prefill_done(self, tokens: int) -> None:
        self.inflight_prefill_tokens -= tokens
        self.inflight_prefills -= 1

    def decode_sent(self) -> None:
        self.inflight_decodes += 1

    def decode_done(self) -> None:
        self.inflight_decodes -= 1
        self.served += 1

    @property
    def role(self) -> str:
        return self.info.role

    def view(self, keys: list[str]) -> WorkerView:
        hits = list(map(self.local_keys.__contains__, keys))  # at C speed: 16 workers x ~32 keys a route
        local = hits.index(False) if False in hits else len(hits)
        load = self.load
        queue = max(load.prefill_queue_tokens if load else 0, self.inflight_prefill_tokens)
        active = (load.active_sequences if load else 0) + self.inflight_decodes
        return WorkerView(name=self.name, role=self.role, queue_tokens=queue, active_sequences=active,
                          kv_tokens=load.kv_tokens if load else 0, max_batch=load.max_batch if load else 32,
                          local_prefix_chunks=local, local_cache_chunks=len(self.local_keys))

    def summary(self) -> dict[str, Any]:
        load = self.load
        return {"name": self.name, "url": self.url, "role": self.role, "status": self.status,
                "served": self.served, "inflight_prefills": self.inflight_prefills,
                "inflight_decodes": self.inflight_decodes, "local_cache_chunks": len(self.local_keys),
                "load": None if load is None else {k: getattr(load, k) for k in _SUMMARY_LOAD},
                **({"kv_events": self.kv_events.summary()} if self.kv_events is not None else {})}


class Workers:
    def __init__(self, backend: Backend, *, on_join: Callable[[WorkerState], Any] | None = None,
                 on_load: Callable[[WorkerState], None] | None = None,
                 kv_events: dict[str, KVEventsSource] | None = None):
        self.kv_events = dict(kv_events or {})  # KV event endpoints of the workers, by URL
        self.backend = backend
        self._on_join = on_join
        self._on_load = on_load
        self.by_url: dict[str, WorkerState] = {}
        self.namespace: str | None = None
        self.model_id: str | None = None
        self._names = 0
        self._task: asyncio.Task | None = None

    # -- membership ----------------------------------------------------------------------------
    async def register(self, url: str, role: str | None = None,
                       kv_events: KVEventsSource | None = None) -> WorkerState:
        """`role`: for a vLLM server (default "both"); a reference worker states its own.
        `kv_events`: where the worker publishes its KV events (else as configured)."""
        url = _normalize(url)
        if kv_events is not None:
            if not self.backend.kv_events:
                raise InvalidArgument("KV event endpoints are for vLLM servers; reference workers send their "
                                      "events with their load")
            self.kv_events[url] = kv_events
        known = self.by_url.get(url)
        if known is not None and known.status != DOWN:
            if kv_events is not None and (known.kv_events is None or known.kv_events.source != kv_events):
                self._follow_events(known)  # told where its events are after it joined
            return known
        info = await self.backend.describe(url, role)
        if self.namespace is not None and (info.namespace != self.namespace or info.model_id != self.model_id):
            raise AlreadyExists(f"worker {url} serves {info.model_id} (namespace {info.namespace[:8]}...), this "
                                f"router {self.model_id} (namespace {self.namespace[:8]}...): refused")
        if self._on_join is not None:
            await self._on_join(url, info)
        if self.namespace is None:
            self.namespace, self.model_id = info.namespace, info.model_id
        if known is not None:  # a worker that came back (restarted on the same address)
            known.info, known.status, known.failures, known.events_since = info, UP, 0, 0
            known.local_keys.clear()
            self._follow_events(known)
            log.info("worker %s (%s) is back at %s", known.name, info.role, url)
            return known
        self._names += 1
        state = WorkerState(url=url, name=f"{info.role}-{self._names}", info=info)
        self.by_url[url] = state
        log.info("worker %s (%s) joined at %s", state.name, info.role, url)
        self._follow_events(state)
        await self._poll_one(state)
        return state

    def _follow_events(self, state: WorkerState) -> None:
        """Start (or restart, empty) the subscriber of a worker with a KV events endpoint."""
        source = self.kv_events.get(state.url)
        if not self.backend.kv_events or source is None:
            return
        if state.kv_events is not None:
            state.kv_events.close()
        index = BlockIndex(state.info.chunk_tokens, namespace_resolver(state.info.namespace, state.info.namespace_doc),
                           held=state.local_keys)
        state.kv_events = KVEventSubscriber(state.name, source, index).start()

    def _forget(self, state: WorkerState) -> None:
        if self.by_url.get(state.url) is state:
            del self.by_url[state.url]
        if state.kv_events is not None:
            state.kv_events.close()
            state.kv_events = None

    def drain(self, url: str) -> WorkerState:
        state = self._find(url)
        self.leaving(state)
        return state

    def remove(self, url: str) -> WorkerState:
        state = self._find(url)
        self._forget(state)
        log.info("worker %s removed", state.name)
        return state

    def leaving(self, state: WorkerState) -> None:
        """The worker is draining (it said so, or answered 503): no new requests."""
        if state.status == UP:
            state.status = DRAINING
            log.info("worker %s is draining: no new requests", state.name)

    def mark_down(self, state: WorkerState, why: str) -> None:
        if state.status == DRAINING:
            self._forget(state)
            log.info("draining worker %s is gone (%s)", state.name, why)
        elif state.status != DOWN:
            state.status, state.down_since = DOWN, time.monotonic()
            log.warning("worker %s out of rotation: %s", state.name, why)

    def _find(self, url: str) -> WorkerState:
        state = self.by_url.get(_normalize(url))
        if state is None:
            raise InvalidArgument(f"no worker {url!r} is registered")
        return state

    def serving(self) -> list[WorkerState]:
        return [s for s in self.by_url.values() if s.status == UP]

    def by_name(self, name: str) -> WorkerState:
        return next(s for s in self.by_url.values() if s.name == name)

    # -- polling -------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="worker-poll")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        for state in list(self.by_url.values()):
            if state.kv_events is not None:
                await state.kv_events.stop()
                state.kv_events = None

    async def _loop(self) -> None:
        while True:
            states = list(self.by_url.values())
            if states:
                await asyncio.gather(*(self._poll_one(s) for s in states), return_exceptions=True)
            await asyncio.sleep(POLL_S)

    async def _poll_one(self, state: WorkerState) -> None:
        try:
            load, events = await self.backend.poll(state)
        except Unavailable as exc:
            state.failures += 1
            if isinstance(exc, WorkerRefused) or state.failures >= FAIL_AFTER:
                self.mark_down(state, str(exc))
            if state.status == DOWN and time.monotonic() - state.down_since > FORGET_S:
                self._forget(state)
                log.info("forgot worker %s (down for %.0f s)", state.name, FORGET_S)
            return
        state.failures, state.load = 0, load
        if state.status == DOWN and not load.draining:
            state.status = UP
            log.info("worker %s is back in rotation", state.name)
        elif state.status == UP and load.draining:
            state.status = DRAINING
        if events is not None:
            self._apply_events(state, events)
        if self._on_load is not None:
            self._on_load(state)
        if (state.status == DRAINING and load.open_streams == 0 and load.queue_length == 0
                and load.active_sequences == 0 and state.inflight_prefills == 0 and state.inflight_decodes == 0):
            self._forget(state)
            log.info("worker %s drained and left", state.name)

    @staticmethod
    def _apply_events(state: WorkerState, resp: wire.EventsResponse) -> None:
        if resp.dropped:  # events were lost: forget what we thought it held (a miss, not a wrong guess)
            state.local_keys.clear()
        for ev in resp.events:
            if ev.tier != "local":
                continue
            if ev.kind == "stored":
                state.local_keys.update(ev.keys)
            elif ev.kind == "removed":
                state.local_keys.difference_update(ev.keys)
        state.events_since = resp.next


def _normalize(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise InvalidArgument(f"worker URL must start with http:// or https://, got {url!r}")
    return url
