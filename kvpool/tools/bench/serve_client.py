"""The load generator of `kvpool bench serve`, usable from Python: `run_serve_bench` sends a
workload's requests to an OpenAI-compatible endpoint at a given arrival rate and returns a
`ServeResult` (per-request records and their summary, see `serve_metrics`).

Requests stream (`stream: true` with `stream_options.include_usage`); the SSE stream is parsed
here, not by a client library, so the time of every chunk is known. A request fails, with its
status and message recorded, on an HTTP error, an error event in the stream, a transport error,
or a stream that ends without content; the run goes on.

Arrivals are Poisson (exponential gaps, seeded: one seed gives the same pattern, scaled, at every
rate), all at once (`rate=inf`), or the trace's own timestamps. `max_concurrency` bounds the
requests in flight; a request's clock starts when it is sent, not while it waits for a slot.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx

from kvpool.tools.bench.serve_metrics import RequestRecord, ServeMetrics, summarize
from kvpool.tools.bench.workloads import Request
from kvpool.errors import InvalidArgument, Unavailable

ENDPOINTS = {"chat": "/chat/completions", "completions": "/completions"}


@dataclass
class SSEEvent:
    """One server-sent event: `kind` is "data" (with `payload`), "done" ([DONE]) or "error"."""

    kind: str
    payload: dict[str, Any] | None = None
    message: str = ""


class SSEParser:
    """Incremental SSE parser: `feed` raw bytes as they arrive (a line may be split anywhere,
    even inside a UTF-8 character), get the events completed so far; `close` at end of stream.

    Events end at a blank line, as the SSE spec says; a `data:` line that is complete JSON (or
    [DONE]) on its own is also taken at once, for servers that omit the blank line.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._data: list[str] = []
        self._event = ""

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        self._buf += chunk
        events: list[SSEEvent] = []
        while (nl := self._buf.find(b"\n")) >= 0:
            line = bytes(self._buf[:nl]).rstrip(b"\r").decode("utf-8", errors="replace")
            del self._buf[:nl + 1]
            events += self._line(line)
        return events

    def close(self) -> list[SSEEvent]:
        events = self.feed(b"\n") if self._buf else []
        return events + self._dispatch()

    def _line(self, line: str) -> list[SSEEvent]:
        if not line:
            return self._dispatch()
        if line.startswith(":"):  # a comment (keep-alive)
            return []
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            self._event = value.strip()
        elif name == "data":
            self._data.append(value)
            if len(self._data) == 1 and _complete(value):
                return self._dispatch()
        return []

    def _dispatch(self) -> list[SSEEvent]:
        if not self._data:
            self._event = ""
            return []
        data, event = "\n".join(self._data), self._event
        self._data, self._event = [], ""
        if data.strip() == "[DONE]":
            return [SSEEvent("done")]
        try:
            payload = json.loads(data)
        except ValueError:
            return [SSEEvent("error", message=f"bad JSON in stream: {data[:200]!r}")]
        if not isinstance(payload, dict):
            return [SSEEvent("error", message=f"unexpected event: {data[:200]!r}")]
        if event == "error" or "error" in payload or payload.get("object") == "error":
            return [SSEEvent("error", payload, _error_message(payload))]
        return [SSEEvent("data", payload)]


def _complete(value: str) -> bool:
    if value.strip() == "[DONE]":
        return True
    try:
        json.loads(value)
    except ValueError:
        return False
    return True


def _error_message(payload: Any) -> str:
    """The human part of an OpenAI-style error body ({"error": {"message": ...}} and variants)."""
    if isinstance(payload, str):
        try:
            payload = json.loads(payload)
        except ValueError:
            return payload.strip()[:300]
    if isinstance(payload, dict):
        err = payload.get("error", payload)
        if isinstance(err, dict):
            msg = err.get("message") or err.get("detail") or json.dumps(err)[:300]
            return str(msg)[:300]
        return str(err)[:300]
    return str(payload)[:300]


def build_payload(request: Request, model: str, endpoint: str, temperature: float = 0.0,
                  extra: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": request.max_tokens, "temperature": temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = request.chat_messages()
    else:
        body["prompt"] = request.prompt()
    body.update(extra or {})
    return body


def _content(payload: dict[str, Any]) -> str:
    choices = payload.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return delta.get("content") or ""
    return choice.get("text") or ""


async def send_request(client: httpx.AsyncClient, url: str, body: dict[str, Any], record: RequestRecord,
                       prompt_words: int = 0) -> RequestRecord:
    """POST one streaming request and fill `record` (times from just before the send)."""
    usage: dict[str, Any] | None = None
    first = last = 0.0
    chunks = 0
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            record.status = resp.status_code
            if resp.status_code != 200:
                record.error = f"HTTP {resp.status_code}: {_error_message((await resp.aread()).decode(errors='replace'))}"
                return record
            parser = SSEParser()
            stream = resp.aiter_bytes()
            done = False
            while not done:
                raw = await anext(stream, None)
                now = time.perf_counter()
                events = parser.close() if raw is None else parser.feed(raw)
                done = raw is None
                for event in events:
                    if event.kind == "error":
                        record.error = f"error event: {event.message}"
                        return record
                    if event.kind == "done" or event.payload is None:
                        continue
                    if event.payload.get("usage"):
                        usage = event.payload["usage"]
                    if _content(event.payload):
                        if chunks == 0:
                            first = now
                        else:
                            record.itl.append(now - last)
                        last = now
                        chunks += 1
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return record
    record.latency = time.perf_counter() - start
    if chunks == 0:
        record.error = "stream ended without content"
        return record
    record.ttft = first - start
    usage = usage or {}
    record.prompt_tokens = int(usage.get("prompt_tokens") or prompt_words)
    record.output_tokens = int(usage.get("completion_tokens") or chunks)
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        record.cached_tokens = int(details["cached_tokens"])
    record.success = True
    return record


def poisson_offsets(n: int, rate: float, seed: int = 0) -> list[float]:
    """Send times (s from the start) of `n` Poisson arrivals at `rate`/s; all 0 for rate inf.
    The first request goes at 0; the gaps are exponential with mean 1/rate."""
    if rate <= 0:
        raise InvalidArgument("rate must be positive")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"arrival-{seed}")
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(1.0) / rate
    return out


def trace_offsets(requests: list[Request], time_scale: float = 1.0) -> list[float]:
    """The trace's own send times, multiplied by `time_scale` (0.5: twice as fast)."""
    if any(r.arrival_s is None for r in requests):
        raise InvalidArgument("trace arrival needs a trace workload (requests with arrival times)")
    return [r.arrival_s * time_scale for r in requests]


async def first_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model id of GET {base_url}/models."""
    url = base_url.rstrip("/") + "/models"
    try:
        resp = await client.get(url)
        resp.raise_for_status()
        models = resp.json()["data"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise Unavailable(f"cannot list models at {url}: {type(exc).__name__}: {exc}") from None
    if not models:
        raise Unavailable(f"{url} lists no model yet (is a worker serving?); or pass --model")
    return models[0]["id"]


@dataclass
class ServeResult:
    """One run: one endpoint at one arrival rate over one request list."""

    label: str
    base_url: str
    model: str
    endpoint: str
    rate: float | str  # req/s (inf: all at once) or "trace"
    offered_rate: float  # requests / span of the send times (inf if all at once)
    metrics: ServeMetrics
    records: list[RequestRecord] = field(default_factory=list)

    def to_json(self, include_requests: bool = False) -> dict[str, Any]:
        doc: dict[str, Any] = {"label": self.label, "base_url": self.base_url, "model": self.model,
                               "endpoint": self.endpoint, "rate": rate_json(self.rate),
                               "offered_rate": rate_json(round(self.offered_rate, 4)), **self.metrics.flat()}
        if include_requests:
            doc["requests"] = [r.to_json() for r in self.records]
        return doc


def rate_json(rate: float | str) -> float | str:
    """JSON has no infinity: an unbounded rate is written "inf"."""
    return "inf" if isinstance(rate, float) and math.isinf(rate) else rate


async def arun_serve_bench(base_url: str, requests: list[Request], rate: float | str = math.inf, *,
                           model: str | None = None, endpoint: str = "chat", max_concurrency: int | None = None,
                           time_scale: float = 1.0, seed: int = 0, temperature: float = 0.0,
                           slos_ms: dict[str, float] | None = None, extra_body: dict[str, Any] | None = None,
                           api_key: str | None = None, timeout_s: float = 600.0, label: str = "",
                           on_done: Callable[[], None] | None = None,
                           client: httpx.AsyncClient | None = None) -> ServeResult:
    """Send `requests` to `base_url` (…/v1) at `rate` req/s (Poisson; inf: all at once; "trace":
    the requests' own arrival times scaled by `time_scale`) and sum up the run."""
    if endpoint not in ENDPOINTS:
        raise InvalidArgument(f"endpoint must be one of {sorted(ENDPOINTS)}")
    offsets = trace_offsets(requests, time_scale) if rate == "trace" else poisson_offsets(len(requests), float(rate), seed)
    span = max(offsets, default=0.0)
    offered = (len(requests) - 1) / span if span > 0 else math.inf
    own = client is None
    if client is None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # No pool limit: a request waiting for a connection would count that wait in its TTFT.
        client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30.0), headers=headers, trust_env=False,
                                   limits=httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=None))
    try:
        model = model or await first_model(client, base_url)
        url = base_url.rstrip("/") + ENDPOINTS[endpoint]
        slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        records = [RequestRecord(index=i) for i in range(len(requests))]
        started = time.perf_counter()

        async def one(i: int) -> None:
            body = build_payload(requests[i], model, endpoint, temperature, extra_body)
            if slots is not None:
                await slots.acquire()
            try:
                records[i].sent_s = time.perf_counter() - started
                await send_request(client, url, body, records[i], requests[i].prompt_words)
            finally:
                if slots is not None:
                    slots.release()
                if on_done is not None:
                    on_done()

        tasks = []
        for i, offset in enumerate(offsets):
            delay = started + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
    finally:
        if own:
            await client.aclose()
    return ServeResult(label=label, base_url=base_url, model=model, endpoint=endpoint, rate=rate,
                       offered_rate=offered, metrics=summarize(records, duration, slos_ms), records=records)


def run_serve_bench(base_url: str, workload_requests: list[Request], rate: float | str = math.inf,
                    **kwargs: Any) -> ServeResult:
    """Blocking `arun_serve_bench` (its own event loop); see there for the keyword arguments."""
    return asyncio.run(arun_serve_bench(base_url, workload_requests, rate, **kwargs))
