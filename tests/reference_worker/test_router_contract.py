"""What a router reads from a worker and how the worker answers it, in-process on the real model:
WorkerInfo sizes, PrefillResponse timings, LoadReport fields, roles, validation and draining
status codes (through the FastAPI app, so the codes are the real ones)."""

from __future__ import annotations

import asyncio
import gc

import pytest
import torch

from kvpool import worker_api as m

pytestmark = pytest.mark.model


def ids_of(n: int, seed: int) -> list[int]:
    return torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_info_carries_context_length_and_kv_bytes_per_token(worker_factory):
    w = worker_factory(role="decode")
    info = w.info()
    assert info.max_positions == 8192  # SmolLM2-135M's max_position_embeddings
    assert info.bytes_per_token == 30 * 2 * 3 * 64 * 4 == w.layout.bytes_per_token  # layers, K+V, heads, dim, fp32


def test_prefill_reports_fetch_and_compute_time(worker_factory):
    ids = ids_of(300, seed=11)
    first = asyncio.run(worker_factory(role="prefill").prefill(m.PrefillRequest(token_ids=ids)))
    assert first.computed_tokens == 300 and first.compute_ms > 0
    assert first.fetch_ms + first.compute_ms <= first.prefill_ms
    # a second worker (empty local cache) reads the first chunk from the pool
    again = asyncio.run(worker_factory(role="prefill").prefill(m.PrefillRequest(token_ids=ids)))
    assert again.pool_cached_tokens == 256 and again.computed_tokens == 44
    assert again.fetch_ms > 0 and 0 < again.compute_ms < first.compute_ms
    assert again.fetch_ms + again.compute_ms <= again.prefill_ms


def test_prefill_queue_tokens_count_a_queued_prompt(worker_factory):
    w = worker_factory(role="prefill", start=False)  # engine thread not started: submitted jobs wait

    async def go():
        task = asyncio.create_task(w.prefill(m.PrefillRequest(token_ids=ids_of(200, seed=12))))
        for _ in range(500):
            if w.engine.queue_length:
                break
            await asyncio.sleep(0.01)
        load = w.load()
        assert load.prefill_queue_tokens == 200 and load.queue_length == 1
        task.cancel()  # the caller goes away: the engine must skip the job, not die resolving it
        with pytest.raises(asyncio.CancelledError):
            await task
        w.start(warmup=False)
        done = await w.prefill(m.PrefillRequest(token_ids=ids_of(30, seed=15)))
        assert done.computed_tokens == 30 and w.load().prefill_queue_tokens == 0
    asyncio.run(go())


def test_decode_token_ms_and_open_streams(worker_factory):
    w = worker_factory(role="both")
    assert w.load().decode_token_ms == 0.0 and w.load().open_streams == 0

    async def go():
        ids = ids_of(20, seed=13)
        held = await w.open_generate(m.GenerateRequest(token_ids=ids, max_tokens=4))
        assert w.load().open_streams == 1  # accepted, not yet read
        events = [e async for e in held]
        assert events[-1].done and w.load().open_streams == 0
        # a stream closed half way, and one dropped before its first line, are released too
        half = await w.open_generate(m.GenerateRequest(token_ids=ids, max_tokens=50, stop_token_ids=[]))
        await half.__anext__()
        assert w.load().open_streams == 1
        await half.aclose()
        dropped = await w.open_generate(m.GenerateRequest(token_ids=ids, max_tokens=4))
        assert w.load().open_streams == 1
        del dropped
        gc.collect()
        assert w.load().open_streams == 0
    asyncio.run(go())
    assert w.load().decode_token_ms > 0
    assert w.wait_idle(30)


def test_roles_for_generate(worker_factory, http_of):
    body = {"token_ids": ids_of(10, seed=14), "max_tokens": 3}
    decode = http_of(worker_factory(role="decode")).post("/v1/generate", json=body)
    assert decode.status_code == 200
    lines = [m.decode(line, m.TokenEvent) for line in decode.text.splitlines()]
    assert lines[0].prefill is not None and lines[-1].done and len(lines) == 4
    refused = http_of(worker_factory(role="prefill")).post("/v1/generate", json=body)
    assert refused.status_code == 400 and refused.json()["code"] == "invalid_argument"


@pytest.mark.parametrize("sampling", [{"top_p": 0.0}, {"top_p": 1.01}, {"temperature": 2.5}, {"temperature": -1}])
def test_out_of_range_sampling_is_400(worker_factory, http_of, sampling):
    http = http_of(worker_factory(role="both"))
    for path in ("/v1/prefill", "/v1/generate"):
        resp = http.post(path, json={"token_ids": [1, 2, 3], "sampling": sampling})
        assert resp.status_code == 400 and resp.json()["code"] == "invalid_argument", resp.text


def test_draining_refuses_new_work_with_503(worker_factory, http_of):
    w = worker_factory(role="both")
    http = http_of(w)
    assert http.get("/health").status_code == 200 and not w.load().draining
    w.start_drain()
    health = http.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "draining"
    for path in ("/v1/prefill", "/v1/generate"):
        resp = http.post(path, json={"token_ids": [1, 2, 3]})
        assert resp.status_code == 503 and resp.json()["code"] == "unavailable"
        assert "draining" in resp.json()["message"]
    assert http.get("/load").json()["draining"] is True
    assert http.post("/v1/tokenize", json={"prompt": "still fine"}).status_code == 200
    assert w.idle()


def test_prefill_takes_the_routers_pool_match_instead_of_asking_again(worker_factory, http_of):
    """`pool_chunks` (the router's match_prefix when it routed the prompt): the worker reads that
    many chunks from the pool without asking it again; a count gone stale reads what is there (the
    read stops at the first chunk missing); without one the worker asks; a negative one is a 400."""
    ids = ids_of(600, seed=12)  # 2 full chunks
    asyncio.run(worker_factory(role="prefill").prefill(m.PrefillRequest(token_ids=ids)))  # both into the pool
    half = ids[:300] + ids_of(300, seed=13)  # only its first chunk is in the pool

    def prefill(prompt: list[int], **extra) -> dict:  # on a fresh worker: its own cache is empty
        resp = http_of(worker_factory(role="prefill")).post("/v1/prefill", json={"token_ids": prompt, **extra})
        assert resp.status_code == 200, resp.text
        return resp.json()

    told_none = prefill(ids, pool_chunks=0)  # the router found nothing: the worker does not look
    assert told_none["pool_cached_tokens"] == 0 and told_none["computed_tokens"] == 600
    one = prefill(ids, pool_chunks=1)
    assert one["pool_cached_tokens"] == 256 and one["computed_tokens"] == 344
    assert prefill(ids, pool_chunks=9)["pool_cached_tokens"] == 512  # more than the prompt has
    stale = prefill(half, pool_chunks=2)  # the second chunk is not there (evicted since, say)
    assert stale["pool_cached_tokens"] == 256 and stale["computed_tokens"] == 344
    asked = prefill(ids)
    assert asked["pool_cached_tokens"] == 512
    assert one["first_token"] == told_none["first_token"] == asked["first_token"]
    bad = http_of(worker_factory(role="prefill")).post("/v1/prefill", json={"token_ids": ids, "pool_chunks": -1})
    assert bad.status_code == 400 and "pool_chunks" in bad.json()["message"]
