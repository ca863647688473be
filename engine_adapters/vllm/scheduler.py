"""The connector's scheduler side (vLLM's scheduler process): how much of a prompt the pool
holds, and the per-step plan for the workers (`metadata.KVPoolConnectorMetadata`).

- `get_num_new_matched_tokens` asks the pool for the longest cached chunk prefix (one
  `match_prefix` per TP rank: each rank holds its own shard, so the usable prefix is the
  shortest), always leaving at least one prompt token to compute; loads are synchronous
  (it returns `False` for "async").
- `build_connector_meta` turns the step into `LoadSpec`s (blocks to fill) and `SaveSpec`s (full
  chunks that become computed in this step); a chunk is handed out for saving once, preemption
  included (a resumed request gets all-new blocks and saves only what it had not).
- `request_finished` delays freeing a request's blocks only for async saves of that request.
- A request's chunk keys are in the namespace salted with its `cache_salt` (vLLM's per-request
  salt, which the router sets per tenant; `ConnectorSettings.namespace`): lookups here, and the
  specs carry the salt so the workers load and save in the same namespace. Without one, the
  configured namespace, as before salts.
- A pool error is a miss: logged, never a failed request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from engine_adapters.vllm.metadata import KVPoolConnectorMetadata, LoadSpec, SaveSpec
from engine_adapters.vllm.settings import ConnectorSettings
from kvpool.contract import PoolClient
from kvpool.errors import KVPoolError
from kvpool.keys import chunk_keys_hex

logger = logging.getLogger(__name__)


@dataclass
class _Track:
    """State of one request between allocation and finish."""

    token_ids: list[int]
    cache_salt: str | None  # vLLM's Request.cache_salt: the namespace of its chunk keys
    saved_chunks: int  # chunks handed to the workers for saving so far (or present in the pool at lookup)
    load: tuple[int, int] | None = None  # token range to load in the next step
    block_ids: list[int] = field(default_factory=list)


class SchedulerSide:
    """The scheduler-role half of `KVPoolConnector` (one per scheduler process)."""

    def __init__(self, settings: ConnectorSettings, pool: Callable[[], PoolClient]):
        self.settings = settings
        self._pool = pool
        self._namespaces = self._namespaces_of(None)  # of requests without a cache_salt
        self._lookups: dict[str, int] = {}  # req id -> chunks found by the last lookup
        self._tracks: dict[str, _Track] = {}
        self._reqs_with_saves: set[str] = set()  # survives preemption: decides request_finished's delay
        self.stats = {"lookups": 0, "hit_chunks": 0}

    def _namespaces_of(self, cache_salt: str | None) -> list[bytes]:
        """Every TP rank's namespace digest for requests carrying `cache_salt`."""
        return [self.settings.namespace(r, cache_salt).digest() for r in range(self.settings.tp_size)]

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond `num_computed_tokens` that the pool holds; loads are synchronous."""
        tokens = list(request.prompt_token_ids or [])
        salt = _cache_salt(request)
        chunk = self.settings.chunk_tokens
        usable = max(0, (len(tokens) - 1) // chunk)  # vLLM must compute at least one token
        found = 0
        if usable:
            self.stats["lookups"] += 1
            try:  # every TP rank holds its own shard: the usable prefix is the shortest
                namespaces = self._namespaces if salt is None else self._namespaces_of(salt)
                found = min(self._pool().match_prefix(chunk_keys_hex(ns, tokens[: usable * chunk], chunk))
                            for ns in namespaces)
            except KVPoolError as exc:
                logger.warning("kvpool lookup failed for request %s, treating as a miss: %s", request.request_id, exc)
        self._lookups[request.request_id] = found
        if not self.settings.loads:
            return 0, False
        return max(0, found * chunk - num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        found = self._lookups.pop(request.request_id, 0)
        track = _Track(token_ids=list(request.prompt_token_ids or []), cache_salt=_cache_salt(request), saved_chunks=found)
        if num_external_tokens > 0:
            end = found * self.settings.chunk_tokens
            track.load = (end - num_external_tokens, end)
            self.stats["hit_chunks"] += found
        self._tracks[request.request_id] = track

    def build_connector_meta(self, scheduler_output: Any) -> KVPoolConnectorMetadata:
        meta = KVPoolConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            track = self._tracks.get(new.req_id)
            if track is not None:
                track.block_ids = list(new.block_ids[0])
                self._plan(meta, new.req_id, track, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None)  # older vLLM: a resumed_from_preemption list
        for i, req_id in enumerate(cached.req_ids):
            track = self._tracks.get(req_id)
            if track is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if new_blocks is not None:
                was_resumed = req_id in resumed if resumed is not None else bool(cached.resumed_from_preemption[i])
                track.block_ids = list(new_blocks[0]) if was_resumed else track.block_ids + list(new_blocks[0])
            self._plan(meta, req_id, track, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _plan(self, meta: KVPoolConnectorMetadata, req_id: str, track: _Track, computed_after_step: int) -> None:
        chunk, block = self.settings.chunk_tokens, self.settings.block_size
        if track.load is not None:
            start, end = track.load
            meta.loads.append(LoadSpec(req_id, track.token_ids[:end], track.block_ids[: end // block], start,
                                       track.cache_salt))
            track.load = None
        full = min(computed_after_step, len(track.token_ids)) // chunk
        if self.settings.saves and full > track.saved_chunks:
            n = full * chunk
            meta.saves.append(SaveSpec(req_id, track.token_ids[:n], track.block_ids[: n // block], track.saved_chunks,
                                       track.cache_salt))
            track.saved_chunks = full
            self._reqs_with_saves.add(req_id)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Delay freeing the blocks only for async saves of this request (see module invariants)."""
        self._lookups.pop(request.request_id, None)
        track = self._tracks.pop(request.request_id, None)
        had_saves = request.request_id in self._reqs_with_saves
        self._reqs_with_saves.discard(request.request_id)
        if track is None:
            return False, None
        # The workers report exactly the requests they got a SaveSpec for: the same set as here.
        delay = self.settings.async_save and had_saves
        params = None
        if self.settings.kv_role == "kv_producer":
            params = {"kvpool_cached_tokens": track.saved_chunks * self.settings.chunk_tokens,
                      "kvpool_chunk_tokens": self.settings.chunk_tokens}
        return delay, params


def _cache_salt(request: Any) -> str | None:
    """vLLM's per-request salt (`Request.cache_salt`, from the OpenAI request's `cache_salt`);
    None for none (an empty one is none, as for vLLM's own prefix cache)."""
    return getattr(request, "cache_salt", None) or None
