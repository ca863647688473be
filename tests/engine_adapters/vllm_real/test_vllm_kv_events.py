"""The router follows real vLLM's KV events (kvpool/router/kv_events.py).

1. vLLM's own publisher (`ZmqEventPublisher`, its `KVEventBatch`/`BlockStored`/`BlockRemoved`
   msgspec classes, its ROUTER replay) feeds the router's subscriber, which starts late and so
   rebuilds the index from the replay, then follows live; and the test publisher of the default
   suite (tests/kvpool/router/kv_event_publisher.py) encodes what vLLM encodes.
2. Two vLLM servers behind the router (`kvpool up --engine vllm --colocated 2`, which starts them
   with `--kv-events-config` and tells the router): a prompt sent straight to the second server
   (so the pool holds its chunks too, and the first server nothing) is then routed, with another
   question, to that second server, whose own prefix cache serves more of it than the pool would
   (block-granular, not only whole chunks). The pool's view alone sees two equal servers and picks
   the first (tests/kvpool/router/test_kv_events.py shows that tie-break). The server's
   /reset_prefix_cache (AllBlocksCleared, published with its next step) empties the router's view.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed here: `make test` runs this suite in .venv-vllm")]

MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
CHUNK = 256  # kvpool up's default
DOCS = Path(__file__).parents[3] / "docs"


def _publisher_helper():
    sys.path.insert(0, str(Path(__file__).parents[2] / "kvpool" / "router"))
    import kv_event_publisher

    return kv_event_publisher


def test_vllms_own_publisher_feeds_the_index_through_its_replay(tmp_path):
    import msgspec
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher

    from kvpool.chunk_format import KVLayout
    from kvpool.keys import Namespace, chunk_keys_hex
    from kvpool.router.kv_events import BlockIndex, KVEventsSource, KVEventSubscriber, namespace_resolver
    from kvpool.tools.launch.processes import free_port

    helper = _publisher_helper()
    block, chunk = 32, 128
    ns = Namespace("m", "w", KVLayout(30, 3, 64, "bfloat16", chunk))
    ids, other = list(range(1000, 1600)), list(range(5000, 5300))
    hashes = helper.block_hashes(ids, block)

    def vllm_stored(seq_ids, first, last):
        h = helper.block_hashes(seq_ids, block)
        return BlockStored(block_hashes=h[first:last], parent_block_hash=h[first - 1] if first else None,
                           token_ids=seq_ids[first * block:last * block], block_size=block, lora_id=None,
                           medium="GPU", lora_name=None, group_idx=0)

    # the default suite's publisher writes what vLLM writes
    mine = msgspec.msgpack.encode([1.5, [helper.stored(ids, block, 0, 4), helper.removed(ids, block, [3])], 0])
    theirs = msgspec.msgpack.encode(KVEventBatch(ts=1.5, events=[
        vllm_stored(ids, 0, 4), BlockRemoved(block_hashes=[hashes[3]], medium="GPU", group_idx=0)],
        data_parallel_rank=0))
    assert msgspec.msgpack.decode(mine) == msgspec.msgpack.decode(theirs)

    endpoint, replay = f"ipc://{tmp_path}/kv", f"tcp://127.0.0.1:{free_port()}"
    pub = ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay)
    index = BlockIndex(chunk, namespace_resolver(ns.hex(), ns.canonical_json()))

    async def main():
        pub.publish(KVEventBatch(ts=time.time(), events=[vllm_stored(ids, 0, 10)]))
        pub.publish(KVEventBatch(ts=time.time(), events=[vllm_stored(ids, 10, 18),
                                                          BlockRemoved(block_hashes=[hashes[17]], medium="GPU")]))
        await asyncio.sleep(0.5)  # published before anyone listened: only the replay has them
        sub = KVEventSubscriber("vllm", KVEventsSource(endpoint, replay), index).start()
        try:
            deadline = time.monotonic() + 30
            while sub.last_seq < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert sub.last_seq == 1 and index.held == set(chunk_keys_hex(ns.digest(), ids, chunk))
            published = 2
            while sub.last_seq < 2 and time.monotonic() < deadline:  # until the SUB socket is connected:
                pub.publish(KVEventBatch(ts=time.time(), events=[  # batches that change nothing
                    BlockRemoved(block_hashes=[b"unknown"], medium="GPU")]))
                published += 1
                await asyncio.sleep(0.3)
            pub.publish(KVEventBatch(ts=time.time(), events=[vllm_stored(other, 0, 9),
                                                              BlockRemoved(block_hashes=[hashes[0]], medium="GPU")]))
            while sub.last_seq < published and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert sub.last_seq == published and sub.resets == 0
        finally:
            await sub.stop()

    try:
        asyncio.run(main())
    finally:
        pub.shutdown()
    keys = chunk_keys_hex(ns.digest(), ids, chunk)
    assert index.held == set(keys[1:]) | set(chunk_keys_hex(ns.digest(), other, chunk))


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory, kvpool_up_vllm):
    """`kvpool up --engine vllm --colocated 2` (float32), its servers in dev mode (/reset_prefix_cache)."""
    workdir = tmp_path_factory.mktemp("up-kv-events")
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    with kvpool_up_vllm(["--colocated", "2", "--set", "up.vllm_dtype=float32", "--port", "0",
                         "--vllm-arg=--max-model-len=1024"], workdir, env) as url:
        yield url


def _workers(url: str) -> dict[str, dict]:
    import httpx

    return {w["name"]: w for w in httpx.get(url + "/admin/workers", timeout=10).json()["workers"]}


def _wait(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


# slow: two vLLM servers of their own (~1.5 min); the events index itself is checked above with
# vLLM's own publisher, and routing by events in tests/kvpool/router/test_kv_events.py.
@pytest.mark.slow
def test_a_repeated_prefix_goes_to_the_vllm_instance_that_caches_it(two_servers):
    import httpx
    from openai import OpenAI

    url = two_servers
    workers = _workers(url)
    assert sorted(workers) == ["both-1", "both-2"], workers
    first, second = workers["both-1"], workers["both-2"]
    assert second["kv_events"]["endpoint"].startswith("ipc://"), "kvpool up told the router where"
    prefix = (DOCS / "router.md").read_text()[:2600]  # ~600 tokens: 2 full chunks, then 32-token blocks

    direct = OpenAI(base_url=second["url"] + "/v1", api_key="unused", max_retries=0, timeout=300)
    direct.completions.create(model=MODEL_ID, prompt=prefix + "\n\nQ: What does the router do?\nA:",
                              max_tokens=1, temperature=0)
    _wait(lambda: _workers(url)["both-2"]["local_cache_chunks"] > 0, "the second server's KV events")
    held = _workers(url)["both-2"]["local_cache_chunks"]
    assert _workers(url)["both-1"]["local_cache_chunks"] == 0

    question = prefix + "\n\nQ: Which policy is the default?\nA:"
    route = httpx.get(url + "/admin/route", params={"prompt": question}, timeout=10).json()
    # the chunks the server's events name are the keys its connector wrote to the pool
    assert route["request"]["pool_prefix_chunks"] == held >= 2, "the pool holds the prefix's chunks too"
    assert route["decision"]["decode"] == "both-2", route

    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    r = client.completions.create(model=MODEL_ID, prompt=question, max_tokens=4, temperature=0)
    assert _workers(url)["both-2"]["served"] == second["served"] + 1
    assert _workers(url)["both-1"]["served"] == first["served"]
    assert r.usage.prompt_tokens_details.cached_tokens > held * CHUNK, \
        "its own prefix cache served whole blocks past the pool's whole chunks"

    httpx.post(second["url"] + "/reset_prefix_cache", timeout=30).raise_for_status()
    # vLLM publishes a step's events after the step: the reset's AllBlocksCleared goes out with the next one
    direct.completions.create(model=MODEL_ID, prompt="Hello", max_tokens=1, temperature=0)
    _wait(lambda: _workers(url)["both-2"]["local_cache_chunks"] == 0, "AllBlocksCleared")
