"""What a worker's own prefix cache holds reaches the router's policy (issue 9): real in-process
workers prefill two conversations, their KV events (`GET /load?events_since=N`, through the app) are applied
to the router's `WorkerState`s as its poll loop applies them, and the real `CacheAware` policy,
on the snapshot those states give, sends each conversation's next round to the worker holding
its prefix (the pool having evicted it), while round robin does not look. An eviction, seen as a
`removed` event, is forgotten by the router too."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from kvpool import worker_api as m
from kvpool.keys import chunk_keys_hex, parse_namespace_hex
from kvpool.router.policy import CacheAware, RoundRobin, RouteRequest, Snapshot, WorkerView
from kvpool.router.workers import Workers, WorkerState

pytestmark = pytest.mark.model

CHUNK = 16


def ids_of(n: int, seed: int) -> list[int]:
    return torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def follow_events(state: WorkerState, http) -> None:
    """One poll of the worker's KV events into the router's view of it, as the router polls
    (`/load?events_since=N`: load and events in one answer, the same events `/v1/events` gives)."""
    resp = http.get(f"/load?events_since={state.events_since}")
    assert resp.status_code == 200
    events = m.decode(resp.content, m.LoadReport).events
    assert events == m.decode(http.get(f"/v1/events?since={state.events_since}").content, m.EventsResponse)
    assert http.get("/load").json()["events"] is None  # not asked for, not sent
    Workers._apply_events(state, events)


def test_cache_aware_routes_a_conversation_to_the_worker_whose_events_show_its_prefix(worker_factory, http_of):
    workers = [worker_factory(role="prefill", chunk_tokens=CHUNK) for _ in range(2)]
    states = [WorkerState(url=f"http://w{i}", name=f"prefill-{i}", info=w.info()) for i, w in enumerate(workers)]
    https = [http_of(w) for w in workers]
    conversations = [ids_of(40, seed=21), ids_of(40, seed=22)]  # 2 full chunks each
    for w, ids in zip(workers, conversations):  # conversation i's first round ran on worker i
        asyncio.run(w.prefill(m.PrefillRequest(token_ids=ids)))
    for state, http in zip(states, https):
        follow_events(state, http)

    namespace = parse_namespace_hex(workers[0].info().namespace)
    decode = WorkerView("decode-9", "decode")
    policy = CacheAware()
    for i, ids in enumerate(conversations):
        next_round = ids + ids_of(20, seed=30 + i)
        keys = chunk_keys_hex(namespace, next_round, CHUNK)  # the router's hashing of the prompt
        views = tuple(s.view(keys) for s in states)
        assert [v.local_prefix_chunks for v in views] == [2 if j == i else 0 for j in range(2)]
        assert [v.local_cache_chunks for v in views] == [2, 2]
        # the pool evicted the conversation (smaller than the working set): only local caches count
        req = RouteRequest(seq=i, prompt_tokens=len(next_round), max_tokens=8, chunk_tokens=CHUNK,
                           pool_prefix_chunks=0, bytes_per_token=workers[0].info().bytes_per_token)
        snap = Snapshot((*views, decode))
        d = policy.choose(req, snap)
        assert d.prefill == f"prefill-{i}" and d.cached_tokens == 2 * CHUNK and d.decode == "decode-9"
        # round robin ignores the caches: conversation 0 at an odd arrival number goes elsewhere
        assert RoundRobin().choose(dataclasses.replace(req, seq=1 - i), snap).prefill != d.prefill

    # worker 0 evicts everything: the `removed` events reach the router, which stops counting on it
    workers[0].cache.clear()
    follow_events(states[0], https[0])
    keys = chunk_keys_hex(namespace, conversations[0], CHUNK)
    assert states[0].view(keys).local_prefix_chunks == 0 and not states[0].local_keys
