"""`kvpool bench serve` without a model server: workloads, metric math, SSE parsing, arrivals,
the request path (over httpx's mock transport) and the report's ratios. The run against a real
cluster is tests/e2e/test_bench_serve.py."""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from kvpool.tools.bench.serve import Target, build_report, plot
from kvpool.tools.bench.serve_client import (SSEParser, ServeResult, poisson_offsets, run_serve_bench, send_request,
                                       trace_offsets)
from kvpool.tools.bench.serve_metrics import RequestRecord, parse_slo, summarize
from kvpool.tools.bench.workloads import (VOCAB, block_text, chat_requests, docqa_requests, mixed_requests,
                                    random_requests, trace_requests)
from kvpool.tools.launch.processes import clean_env

REAL_TRACE = Path("/work/shared/data/traces/conversation_trace.jsonl")


# --- workloads -------------------------------------------------------------------------------

def test_workloads_are_deterministic_per_seed():
    for make in (lambda s: random_requests(20, 50, 8, 0.3, seed=s),
                 lambda s: chat_requests(4, 3, 2, 100, 20, 16, seed=s),
                 lambda s: docqa_requests(3, 200, 2, 16, seed=s),
                 lambda s: mixed_requests(20, 0.3, 1500, 150, 64, 0.1, seed=s)):
        assert make(7) == make(7)
        assert make(7) != make(8)


def test_random_lengths_and_vocabulary():
    reqs = random_requests(200, 100, 20, 0.5, seed=1)
    assert len(reqs) == 200
    lens = [len(r.messages[0][1].split()) for r in reqs]
    assert all(50 <= n <= 150 for n in lens) and len(set(lens)) > 20
    assert all(10 <= r.max_tokens <= 30 for r in reqs)
    assert all(r.prompt_words == n for r, n in zip(reqs, lens))
    assert set(reqs[0].messages[0][1].split()) <= set(VOCAB)
    fixed = random_requests(5, 64, 8, 0.0, seed=1)
    assert {len(r.messages[0][1].split()) for r in fixed} == {64} and {r.max_tokens for r in fixed} == {8}


def test_mixed_has_its_fraction_of_long_prompts():
    reqs = mixed_requests(400, 0.3, 1500, 150, 64, 0.1, seed=2)
    long = [r for r in reqs if r.tag.startswith("long")]
    assert 0.24 < len(long) / len(reqs) < 0.36
    assert all(1350 <= r.prompt_words <= 1650 for r in long)
    assert all(135 <= r.prompt_words <= 165 for r in reqs if r not in long)
    assert len({r.messages[0][1] for r in reqs}) == len(reqs)  # every prompt new: nothing cached
    assert {r.tag for r in mixed_requests(20, 0.0, 1500, 150, 64, seed=2)} == {f"short {i}" for i in range(20)}


def test_chat_rounds_extend_the_conversation():
    conv, rounds, systems = 5, 3, 2
    reqs = chat_requests(conv, rounds, systems, system_len=300, turn_len=20, output_len=16, seed=0)
    assert len(reqs) == conv * rounds
    by_tag = {r.tag: r for r in reqs}
    # round-major: every round-1 request is sent before any round-2 request
    assert [r.tag for r in reqs[:conv]] == [f"chat c{c} r0" for c in range(conv)]
    for c in range(conv):
        for k in range(1, rounds):
            earlier, later = by_tag[f"chat c{c} r{k - 1}"], by_tag[f"chat c{c} r{k}"]
            assert later.messages[: len(earlier.messages)] == earlier.messages
            assert [role for role, _ in later.messages[len(earlier.messages):]] == ["assistant", "user"]
            assert later.prompt().startswith(earlier.prompt())  # the completions text shares it too
            assert later.prompt_words > earlier.prompt_words
    # conversations with the same system prompt share it, byte for byte; others do not
    sys_of = [by_tag[f"chat c{c} r0"].messages[0] for c in range(conv)]
    assert sys_of[0] == sys_of[2] == sys_of[4] and sys_of[1] == sys_of[3] and sys_of[0] != sys_of[1]
    assert sys_of[0][0] == "system" and len(sys_of[0][1].split()) >= 300


def test_docqa_documents_repeat_interleaved():
    docs, questions = 3, 4
    reqs = docqa_requests(docs, doc_len=500, questions=questions, output_len=8, seed=0)
    assert len(reqs) == docs * questions
    texts = [r.messages[0][1] for r in reqs]
    doc_of = [t.split("\n\nQuestion:")[0] for t in texts]
    assert len(set(doc_of)) == docs
    for i in range(len(reqs) - docs):
        assert doc_of[i] == doc_of[i + docs] and doc_of[i] != doc_of[i + 1]
        assert texts[i] != texts[i + docs]  # another question
    assert all(len(d.split()) > 500 for d in doc_of)


def _write_trace(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_trace_equal_hash_ids_give_identical_text(tmp_path):
    rows = [{"timestamp": 1000, "input_length": 1100, "output_length": 320, "hash_ids": [0, 1, 2]},
            {"timestamp": 1500, "input_length": 1536, "output_length": 16, "hash_ids": [0, 1, 3]},
            {"timestamp": 4000, "input_length": 100, "output_length": 5000, "hash_ids": [7]}]
    trace = _write_trace(tmp_path / "t.jsonl", rows)
    a, b, c = trace_requests(trace, block_words=32, max_output=64)
    assert trace_requests(trace, block_words=32, max_output=64) == [a, b, c]
    shared = block_text(0, 32) + " " + block_text(1, 32) + " "
    assert a.messages[0][1].startswith(shared) and b.messages[0][1].startswith(shared)
    assert a.messages[0][1][len(shared):] != b.messages[0][1][len(shared):]
    # 1100 tokens = 2 full blocks + 76 tokens: the last block keeps ceil(76/512*32) = 5 words
    assert a.prompt_words == 64 + 5 and b.prompt_words == 96 and c.prompt_words == 7
    assert c.messages[0][1] == " ".join(block_text(7, 32).split()[:7])
    # output scaled like the input (32/512) and capped
    assert (a.max_tokens, b.max_tokens, c.max_tokens) == (20, 1, 64)
    assert [r.arrival_s for r in (a, b, c)] == [0.0, 0.5, 3.0]
    assert trace_offsets([a, b, c], time_scale=2.0) == [0.0, 1.0, 6.0]
    assert len(trace_requests(trace, limit=2)) == 2
    assert trace_requests(trace, output_scale=1.0, max_output=1000)[0].max_tokens == 320


def test_trace_rejects_a_bad_line(tmp_path):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        trace_requests(trace)


@pytest.mark.skipif(not REAL_TRACE.exists(), reason="the shared Mooncake trace is not on this machine")
def test_real_trace_replays():
    reqs = trace_requests(REAL_TRACE, limit=200, block_words=32)
    assert len(reqs) == 200
    with REAL_TRACE.open() as f:
        rows = [json.loads(next(f)) for _ in range(200)]
    arrivals = [r.arrival_s for r in reqs]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    assert arrivals[-1] == (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000
    for req, row in zip(reqs, rows):
        assert len(row["hash_ids"]) * 32 - 32 < req.prompt_words <= len(row["hash_ids"]) * 32
        assert 1 <= req.max_tokens <= 64
    # the trace's shared first block (hash 0) becomes a shared text prefix
    head = block_text(rows[0]["hash_ids"][0], 32)
    sharing = [req for req, row in zip(reqs, rows) if row["hash_ids"][0] == rows[0]["hash_ids"][0]]
    assert len(sharing) > 10 and all(r.messages[0][1].startswith(head) for r in sharing)


def test_salt_changes_only_the_front():
    r = chat_requests(1, 2, 1, 50, 10, 8)[1]
    s = r.salted("Run 3. ")
    assert s.messages[0][1] == "Run 3. " + r.messages[0][1] and s.messages[1:] == r.messages[1:]


# --- metrics ---------------------------------------------------------------------------------

def _rec(i, ttft, latency, out, itl=(), prompt=100, cached=None, ok=True, error=""):
    return RequestRecord(index=i, success=ok, ttft=ttft, latency=latency, itl=list(itl), prompt_tokens=prompt,
                         output_tokens=out, cached_tokens=cached, error=error)


def test_tpot_itl_percentiles_throughput():
    records = [_rec(0, 0.1, 1.1, 11, itl=[0.1] * 10, cached=50),
               _rec(1, 0.2, 0.6, 5, itl=[0.05, 0.15, 0.1, 0.1], cached=0),
               _rec(2, 0.3, 0.3, 1),  # one token: no TPOT, no gaps
               _rec(3, 0.4, 2.4, 3, itl=[1.0, 1.0]),
               _rec(4, 0, 0, 0, ok=False, error="HTTP 500: boom")]
    m = summarize(records, duration_s=2.0)
    assert (m.completed, m.failed) == (4, 1)
    assert m.errors == ["request 4: HTTP 500: boom"]
    ttfts = np.array([100, 200, 300, 400.0])
    assert m.ttft.mean == pytest.approx(250) and m.ttft.median == pytest.approx(250)
    assert m.ttft.p99 == pytest.approx(397) and m.ttft.p90 == pytest.approx(370)
    assert m.ttft.std == pytest.approx(float(ttfts.std()))
    tpots = [100.0, 100.0, 1000.0]  # (1.1-0.1)/10, (0.6-0.2)/4, (2.4-0.4)/2
    assert m.tpot.count == 3 and m.tpot.mean == pytest.approx(statistics.mean(tpots))
    assert m.tpot.median == pytest.approx(100.0)
    gaps = [100.0] * 10 + [50, 150, 100, 100] + [1000, 1000]
    assert m.itl.count == 16 and m.itl.mean == pytest.approx(statistics.mean(gaps))
    assert m.itl.p99 == pytest.approx(float(np.percentile(gaps, 99)))
    assert m.e2e.p90 == pytest.approx(float(np.percentile([1100, 600, 300, 2400], 90)))
    assert m.request_throughput == pytest.approx(2.0)
    assert m.total_output_tokens == 20 and m.output_throughput == pytest.approx(10.0)
    assert m.total_token_throughput == pytest.approx((400 + 20) / 2)
    assert m.mean_cached_tokens == pytest.approx(25.0)  # only requests that reported it
    assert m.goodput is None
    flat = m.flat()
    assert flat["ttft_p99"] == pytest.approx(397) and flat["completed"] == 4 and flat["itl_count"] == 16


def test_goodput_needs_every_slo():
    records = [_rec(0, 0.1, 1.1, 11), _rec(1, 0.2, 0.6, 5), _rec(2, 0.3, 0.3, 1), _rec(3, 0.4, 2.4, 3),
               _rec(4, 0, 0, 0, ok=False)]
    ttft = dict([parse_slo("ttft:250")])
    assert summarize(records, 2.0, ttft).goodput == pytest.approx(1.0)  # requests 0 and 1
    both = dict([parse_slo("ttft:350"), parse_slo("tpot:150")])
    assert summarize(records, 2.0, both).goodput == pytest.approx(1.5)  # 0, 1, and 2 (one token: TPOT 0)
    e2e = dict([parse_slo("e2el:1000")])
    assert summarize(records, 2.0, e2e).goodput == pytest.approx(1.0)  # 1 and 2
    assert parse_slo("e2e:5") == ("e2e", 5.0)
    for bad in ("ttft", "foo:1", "ttft:x", "tpot:-1"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_empty_run_is_zeros_not_an_error():
    m = summarize([_rec(0, 0, 0, 0, ok=False, error="x")], duration_s=0.0)
    assert m.completed == 0 and m.ttft.mean == 0 and m.request_throughput == 0 and m.mean_cached_tokens is None


# --- SSE -------------------------------------------------------------------------------------

STREAM = ('data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
          ': keep-alive\n\n'
          'data: {"choices":[{"index":0,"delta":{"content":"Hel"}}]}\r\n\r\n'
          'data: {"choices":[{"index":0,"delta":{"content":"lo \u00e9t\u00e9"}}]}\n\n'  # UTF-8: 2 bytes each
          'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2,'
          '"prompt_tokens_details":{"cached_tokens":4}}}\n\n'
          'data: [DONE]\n\n').encode()


def _kinds(events):
    return [(e.kind, e.payload) for e in events]


def test_sse_whole_stream():
    parser = SSEParser()
    events = parser.feed(STREAM) + parser.close()
    assert [e.kind for e in events] == ["data", "data", "data", "data", "done"]
    assert events[2].payload["choices"][0]["delta"]["content"] == "lo \u00e9t\u00e9"
    assert events[3].payload["usage"]["prompt_tokens_details"]["cached_tokens"] == 4


def test_sse_chunks_split_anywhere():
    whole = SSEParser()
    want = _kinds(whole.feed(STREAM) + whole.close())
    for cut in range(1, len(STREAM)):  # every split point, inside "data:", JSON and UTF-8 alike
        parser = SSEParser()
        got = parser.feed(STREAM[:cut]) + parser.feed(STREAM[cut:]) + parser.close()
        assert _kinds(got) == want, cut
    parser = SSEParser()
    got = [e for i in range(len(STREAM)) for e in parser.feed(STREAM[i:i + 1])] + parser.close()
    assert _kinds(got) == want


def test_sse_error_events_and_oddities():
    parser = SSEParser()
    events = parser.feed(b'data: {"error": {"message": "out of memory", "code": 500}}\n\n'
                         b'event: error\ndata: {"message": "overloaded"}\n\n'
                         b'data: {"object": "error", "message": "bad model"}\n\n'
                         b'data: not json\n\n'
                         b'data: {"a":\ndata: 1}\n\n'  # one event over two data lines
                         b'data: {"b": 2}\ndata: [DONE]\n')  # no blank lines at all
    events += parser.close()
    assert [(e.kind, e.message) for e in events[:4]] == [
        ("error", "out of memory"), ("error", "overloaded"), ("error", "bad model"),
        ("error", "bad JSON in stream: 'not json'")]
    assert _kinds(events[4:]) == [("data", {"a": 1}), ("data", {"b": 2}), ("done", None)]


# --- the request path, over httpx's mock transport -----------------------------------------

def _chunk(text):
    return f'data: {json.dumps({"choices": [{"index": 0, "delta": {"content": text}}]})}\n\n'.encode()


def _client(handler) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://test")


def _send(handler, body=None) -> RequestRecord:
    async def go():
        async with _client(handler) as client:
            return await send_request(client, "http://test/v1/chat/completions", body or {"stream": True},
                                      RequestRecord(index=0), prompt_words=9)
    return asyncio.run(go())


def test_send_request_reads_usage_and_cached_tokens():
    async def body():
        for part in (_chunk("a"), _chunk("b"), _chunk("c")):
            await asyncio.sleep(0.01)
            yield part
        yield (b'data: {"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":5,'
               b'"prompt_tokens_details":{"cached_tokens":8}}}\n\ndata: [DONE]\n\n')

    rec = _send(lambda request: httpx.Response(200, content=body()))
    assert rec.success and rec.status == 200 and rec.error == ""
    assert (rec.prompt_tokens, rec.output_tokens, rec.cached_tokens) == (12, 5, 8)
    assert len(rec.itl) == 2 and all(g >= 0.005 for g in rec.itl)
    assert 0.005 <= rec.ttft <= rec.latency and rec.latency >= rec.ttft + sum(rec.itl) - 1e-6


def test_send_request_without_usage_counts_chunks():
    rec = _send(lambda request: httpx.Response(200, content=_chunk("x") * 4 + b"data: [DONE]\n\n"))
    assert rec.success and rec.output_tokens == 4 and rec.prompt_tokens == 9 and rec.cached_tokens is None


def test_send_request_failures_are_recorded_not_raised():
    rec = _send(lambda request: httpx.Response(503, json={"error": {"message": "no decode worker"}}))
    assert not rec.success and rec.status == 503 and rec.error == "HTTP 503: no decode worker"
    rec = _send(lambda request: httpx.Response(200, content=_chunk("a") + b'data: {"error": {"message": "boom"}}\n\n'))
    assert not rec.success and rec.error == "error event: boom"
    rec = _send(lambda request: httpx.Response(200, content=b"data: [DONE]\n\n"))
    assert not rec.success and "without content" in rec.error

    def refuse(request):
        raise httpx.ConnectError("connection refused")
    rec = _send(refuse)
    assert not rec.success and rec.error == "ConnectError: connection refused"


def test_run_serve_bench_bounds_concurrency_and_reports():
    state = {"now": 0, "max": 0, "bodies": []}

    async def handler(request):
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"data": [{"id": "m1"}, {"id": "m2"}]})
        state["bodies"].append(json.loads(request.content))

        async def body():
            state["now"] += 1
            state["max"] = max(state["max"], state["now"])
            for _ in range(3):
                await asyncio.sleep(0.01)
                yield _chunk("t")
            state["now"] -= 1
            yield b'data: {"choices":[],"usage":{"prompt_tokens":20,"completion_tokens":3}}\n\ndata: [DONE]\n\n'
        return httpx.Response(200, content=body())

    reqs = random_requests(6, 20, 3, seed=0)
    done = []

    async def go():
        async with _client(handler) as client:
            return await _run(client)

    async def _run(client):
        from kvpool.tools.bench.serve_client import arun_serve_bench
        return await arun_serve_bench("http://test/v1", reqs, math.inf, max_concurrency=2, client=client,
                                      label="ours", slos_ms={"ttft": 10_000}, on_done=lambda: done.append(1))

    result = asyncio.run(go())
    assert isinstance(result, ServeResult) and result.model == "m1"
    assert state["max"] == 2 and len(done) == 6
    m = result.metrics
    assert m.completed == 6 and m.failed == 0 and m.total_output_tokens == 18 and m.goodput == m.request_throughput
    body = state["bodies"][0]
    assert body["model"] == "m1" and body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0.0 and body["max_tokens"] == 3 and "ignore_eos" not in body
    assert body["messages"] == [{"role": "user", "content": reqs[0].messages[0][1]}]
    doc = result.to_json(include_requests=True)
    assert doc["rate"] == "inf" and doc["completed"] == 6 and len(doc["requests"]) == 6
    json.dumps(doc)


def test_run_serve_bench_unreachable_is_an_error_not_a_traceback():
    from kvpool.errors import Unavailable

    with pytest.raises(Unavailable, match="cannot list models"):
        run_serve_bench("http://127.0.0.1:9/v1", random_requests(1, 5, 2), 1.0)


# --- arrivals --------------------------------------------------------------------------------

def test_poisson_arrivals_have_the_right_mean():
    offsets = poisson_offsets(20_000, rate=4.0, seed=3)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() == pytest.approx(0.25, rel=0.05)  # exponential: std = mean
    assert poisson_offsets(100, 4.0, seed=3) == offsets[:100]
    assert poisson_offsets(100, 4.0, seed=4) != offsets[:100]
    assert np.allclose(poisson_offsets(100, 2.0, seed=3), np.array(offsets[:100]) * 2)  # same pattern, scaled
    assert poisson_offsets(5, math.inf) == [0.0] * 5


# --- report ----------------------------------------------------------------------------------

def _result(label, rate, ttft, throughput):
    records = [_rec(i, ttft, ttft + 1.0, 11) for i in range(4)]
    return ServeResult(label=label, base_url="u", model="m", endpoint="chat", rate=rate, offered_rate=rate,
                       metrics=summarize(records, 4 / throughput), records=records)


def test_report_ratios_point_the_right_way(tmp_path):
    runs = [_result("ours", 1.0, 0.1, 2.0), _result("vllm", 1.0, 0.2, 1.0),
            _result("ours", math.inf, 0.3, 4.0), _result("vllm", math.inf, 0.3, 4.0)]
    report = build_report(runs, [Target("ours", "u", "m"), Target("vllm", "u", "m")])
    by = {(r.rate, r.case): r for r in report.results}
    ttft = by[(1.0, "ttft_mean")]
    assert ttft.value == pytest.approx(100) and ttft.baseline == "vllm" and ttft.baseline_value == pytest.approx(200)
    assert ttft.ratio == pytest.approx(2.0)  # latency: baseline / ours
    assert ttft.spread == [pytest.approx(100), pytest.approx(100)]
    assert by[(1.0, "request_throughput")].ratio == pytest.approx(2.0)  # throughput: ours / baseline
    assert by[(1.0, "failed")].ratio is None and by[("inf", "ttft_p99")].ratio == pytest.approx(1.0)
    assert {r.case for r in report.results if r.rate == 1.0} >= {
        "ttft_mean", "ttft_median", "ttft_p90", "ttft_p99", "ttft_std", "tpot_mean", "itl_p99", "e2e_p99",
        "request_throughput", "output_throughput", "total_token_throughput", "completed", "failed"}
    assert "goodput" not in {r.case for r in report.results}
    doc = report.results[0].to_json()
    assert set(doc) >= {"case", "rate", "value", "unit", "baseline", "baseline_value", "ratio", "spread"}
    pytest.importorskip("matplotlib")
    assert plot(runs, tmp_path / "p.png", "t").startswith("wrote") and (tmp_path / "p.png").stat().st_size > 1000


def test_cli_fails_requests_cleanly_and_ends_with_json(tmp_path):
    """No server on the port: every request fails with its message; the JSON line still comes."""
    env = clean_env()
    (tmp_path / "w.toml").write_text('kind = "docqa"\ndoc_len = 20\nwarmup = 0\n')
    r = subprocess.run([str(Path(sys.executable).with_name("kvpool")), "bench", "serve", "--base-url",
                        "http://127.0.0.1:9/v1", "--model", "m", "--workload", str(tmp_path / "w.toml"),
                        "--num-requests", "4", "--rate", "50,inf", "--json"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert doc["bench"] == "serve" and doc["label"] == "ours" and doc["config"]["rates"] == [50.0, "inf"]
    assert doc["config"]["kind"] == "docqa" and doc["config"]["doc_len"] == 20 and doc["config"]["num_requests"] == 4
    assert [run["rate"] for run in doc["runs"]] == [50.0, "inf"]
    assert all(run["failed"] == 4 and run["completed"] == 0 and "ConnectError" in run["errors"][0]
               for run in doc["runs"])
    assert {(x["rate"], x["case"]) for x in doc["results"]} >= {(50.0, "ttft_mean"), ("inf", "failed")}
    assert any("4 of 4 failed" in note for note in doc["notes"])
