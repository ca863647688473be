"""The official `openai` client against the router in front of real workers: greedy text equals
a single-process `model.generate`, streamed text equals the non-streamed text, stop strings,
seeded sampling, cached prompt tokens reported, and OpenAI-shaped 4xx errors."""

from __future__ import annotations

import subprocess

import httpx
import openai
import pytest

from e2e_support import reference

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SYSTEM = " ".join(f"Rule {i}: vessel class {chr(65 + i % 26)} docks at pier {i * 3 % 17} after {i % 5 + 1} "
                  f"bells, and its cargo of {['salt', 'tea', 'iron', 'wool'][i % 4]} is weighed twice."
                  for i in range(24))  # ~700 tokens: several full chunks


def _chat(messages, **kw):
    return {"model": MODEL, "messages": messages, "temperature": 0, **kw}


def _greedy_text(rm, ids, n):
    return rm.decode(reference(rm, ids, n))


def _stream_text(client, **kw):
    chunks = list(client.chat.completions.create(stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return text, finish, chunks


def test_models_and_health(openai_client, cluster):
    assert [m.id for m in openai_client.models.list().data] == [MODEL]
    assert httpx.get(f"{cluster.router_url}/health").status_code == 200
    listed = httpx.get(f"{cluster.router_url}/admin/workers").json()["workers"]
    assert sorted(w["role"] for w in listed) == ["both", "decode", "prefill"]


@pytest.mark.parametrize("question", ["Which pier does class C use?", "Hi"])
def test_chat_greedy_equals_generate_and_stream_equals_whole(openai_client, rm, question):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    want = _greedy_text(rm, rm.encode_chat(messages), 24)
    whole = openai_client.chat.completions.create(**_chat(messages, max_tokens=24))
    assert whole.choices[0].message.content == want
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(rm.encode_chat(messages))
    assert 1 <= whole.usage.completion_tokens <= 24
    text, finish, chunks = _stream_text(openai_client, stream_options={"include_usage": True},
                                        **_chat(messages, max_tokens=24))
    assert text == want and finish == [whole.choices[0].finish_reason]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.id == chunks[0].id for c in chunks)


def test_short_chat_without_system_prompt(openai_client, rm):
    messages = [{"role": "user", "content": "Name a colour."}]
    out = openai_client.chat.completions.create(**_chat(messages, max_completion_tokens=12))
    assert out.choices[0].message.content == _greedy_text(rm, rm.encode_chat(messages), 12)


def test_completions_greedy_stream_and_whole(openai_client, rm):
    prompt = "The harbour master wrote in the log that the"
    want = _greedy_text(rm, rm.encode(prompt), 20)
    whole = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    assert whole.choices[0].text == want and whole.object == "text_completion"
    stream = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == want
    by_ids = openai_client.completions.create(model=MODEL, prompt=rm.encode(prompt), max_tokens=20, temperature=0)
    assert by_ids.choices[0].text == want


def test_cached_prefix_is_reported(openai_client):
    messages = [{"role": "system", "content": SYSTEM + " Extra note on tides."}, {"role": "user", "content": "Q1?"}]
    first = openai_client.chat.completions.create(**_chat(messages, max_tokens=2))
    messages[-1]["content"] = "Q2?"
    second = openai_client.chat.completions.create(**_chat(messages, max_tokens=2))
    assert first.usage.prompt_tokens > 512
    assert second.usage.prompt_tokens_details.cached_tokens >= 512  # the shared system prompt's chunks


def test_stop_strings_cut_the_text(openai_client, rm):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which pier does class C use?"}]
    full = _greedy_text(rm, rm.encode_chat(messages), 24)
    words = full.split()
    assert len(words) >= 3, full
    stop = " " + words[2]
    want = full[:full.index(stop)]
    out = openai_client.chat.completions.create(**_chat(messages, max_tokens=24, stop=[stop, "zzzz"]))
    assert out.choices[0].message.content == want and out.choices[0].finish_reason == "stop"
    text, finish, _ = _stream_text(openai_client, **_chat(messages, max_tokens=24, stop=stop))
    assert text == want and finish == ["stop"]


def test_seeded_sampling_is_reproducible(openai_client):
    messages = [{"role": "user", "content": "Write a short line about the sea."}]
    kw = dict(model=MODEL, messages=messages, max_tokens=16, temperature=1.0, top_p=0.95)
    a = openai_client.chat.completions.create(seed=11, **kw).choices[0].message.content
    b = openai_client.chat.completions.create(seed=11, **kw).choices[0].message.content
    others = {openai_client.chat.completions.create(seed=s, **kw).choices[0].message.content for s in (12, 13, 14)}
    assert a == b
    assert len(others | {a}) > 1  # four seeds giving one text would mean the seed is ignored


def test_bad_requests_get_openai_errors(openai_client, cluster):
    user = [{"role": "user", "content": "hi"}]
    cases = [(dict(model=MODEL, messages=[]), openai.BadRequestError, "messages"),
             (dict(model=MODEL, messages=user, max_tokens=0), openai.BadRequestError, "max_tokens"),
             (dict(model=MODEL, messages=user, n=2), openai.BadRequestError, "n"),
             (dict(model="gpt-imaginary", messages=user), openai.NotFoundError, "model")]
    for kw, error, param in cases:
        with pytest.raises(error) as info:
            openai_client.chat.completions.create(**kw)
        assert info.value.body["param"] == param, info.value.body
    long = [{"role": "user", "content": "word " * 9000}]
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(model=MODEL, messages=long, max_tokens=5)
    assert info.value.body["code"] == "context_length_exceeded"
    raw = httpx.post(f"{cluster.router_url}/v1/chat/completions", content=b"{not json",
                     headers={"content-type": "application/json"})
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    wrong = httpx.get(f"{cluster.router_url}/v1/chat/completions")
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"


def test_metrics_report_requests_and_pressure(openai_client, cluster):
    openai_client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    text = httpx.get(f"{cluster.router_url}/metrics").text
    assert 'kvpool_router_requests_total{endpoint="completions",status="200"}' in text
    assert 'kvpool_router_pressure{side="prefill"}' in text and 'kvpool_router_bottleneck{side="decode"}' in text
    assert "kvpool_router_route_seconds_count" in text


def test_admission_refuses_with_429_early(cluster, tmp_path):
    """A second router over the same workers with an impossible TTFT target refuses at once."""
    from kvpool.tools.launch.local import KVPOOL

    urls = [p.url for p in cluster.workers.values()]
    ready = tmp_path / "router.ready"
    args = ["router", "--port", "0", "--pool", cluster.pool_address, "--set", "router.ttft_slo_ms=0.001",
            "--ready-file", str(ready)] + [x for u in urls for x in ("--worker", u)]
    proc = subprocess.Popen([*KVPOOL, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import json
        import time

        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            assert proc.poll() is None
            time.sleep(0.05)
        base = json.loads(ready.read_text())["url"]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(**_chat([{"role": "user", "content": "hi"}], max_tokens=4))
        assert "TTFT" in info.value.body["message"] and info.value.body["code"] == "rate_limit_exceeded"
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_client_leaving_a_stream_frees_its_worker(cluster):
    """A client that disconnects after its first token: the router closes its stream to the
    worker at once (that worker stops decoding it) instead of running it to max_tokens."""
    import time

    body = _chat([{"role": "user", "content": "Count from 1 to 1000, separated by commas."}], max_tokens=400,
                 stream=True)
    with httpx.stream("POST", f"{cluster.router_url}/v1/chat/completions", json=body, timeout=120) as resp:
        for line in resp.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                break
    left = time.monotonic()

    def decoding() -> int:
        workers = httpx.get(f"{cluster.router_url}/admin/workers").json()["workers"]
        return sum(w["inflight_decodes"] + ((w["load"] or {}).get("open_streams") or 0) for w in workers)

    while decoding() and time.monotonic() - left < 5:  # 400 tokens would take ~20 s here
        time.sleep(0.1)
    assert decoding() == 0, httpx.get(f"{cluster.router_url}/admin/workers").json()
