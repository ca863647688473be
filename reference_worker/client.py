"""HTTP client of the reference workers (httpx, sync) and the disaggregated path as one call.

`generate(prefill, decode, token_ids)` is what `kvpool generate`, `kvpool up --demo`, the e2e
tests and benchmarks run: the prompt goes to the prefill worker, its KV handle to the decode
worker, and the tokens stream back. Error answers become the `kvpool.errors` class they name.
"""

from __future__ import annotations

import itertools
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Sequence

import httpx

from kvpool.admin.client import HttpClient, raise_for
from kvpool.handle import KVHandle
from kvpool import worker_api as m
from kvpool.errors import CorruptObject, KeyNotFound, Unavailable, error_from_code


class WorkerClient(HttpClient):
    def __init__(self, url: str, timeout: float = 600.0, headers: dict[str, str] | None = None):
        """`headers` go with every request: with a keyring, the internal bearer token
        (`kvpool.security.http_guard.internal_headers`) and the tenant (`X-KVPool-Tenant`)."""
        super().__init__(url, what="the worker", timeout=httpx.Timeout(timeout, connect=10.0), headers=headers)

    def _post(self, path: str, msg: Any, type_: type) -> Any:
        resp = self.request("POST", path, content=m.encode(msg), headers={"content-type": "application/json"})
        return m.decode(resp.content, type_)

    def info(self) -> m.WorkerInfo:
        return m.decode(self.request("GET", "/v1/info").content, m.WorkerInfo)

    def tokenizer_info(self) -> m.TokenizerInfo:
        return m.decode(self.request("GET", "/v1/tokenizer").content, m.TokenizerInfo)

    def load(self) -> m.LoadReport:
        return m.decode(self.request("GET", "/load").content, m.LoadReport)

    def events(self, since: int = 0) -> m.EventsResponse:
        return m.decode(self.request("GET", "/v1/events", params={"since": since}).content, m.EventsResponse)

    def metrics(self) -> str:
        return self.request("GET", "/metrics").text

    def clear_cache(self) -> int:
        return int(self.request("POST", "/v1/cache/clear").json()["removed_chunks"])

    def tokenize(self, prompt: str | None = None, messages: Sequence[dict] | None = None) -> list[int]:
        msgs = None if messages is None else [m.ChatMessage(role=x["role"], content=x["content"]) for x in messages]
        return self._post("/v1/tokenize", m.TokenizeRequest(prompt=prompt, messages=msgs), m.TokenizeResponse).token_ids

    def prefill(self, token_ids: Sequence[int], request_id: str | None = None,
                sampling: m.SamplingParams | None = None) -> m.PrefillResponse:
        return self._post("/v1/prefill", m.PrefillRequest(token_ids=list(token_ids), request_id=request_id,
                                                          sampling=sampling), m.PrefillResponse)

    def _stream(self, path: str, msg: Any) -> Iterator[m.TokenEvent]:
        try:
            with self._http.stream("POST", path, content=m.encode(msg),
                                   headers={"content-type": "application/json"}) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise_for(resp)
                for line in resp.iter_lines():
                    if not line.strip():
                        continue
                    event = m.decode(line, m.TokenEvent)
                    if event.error is not None:
                        raise error_from_code(event.error.code, event.error.message)
                    yield event
        except httpx.HTTPError as exc:
            raise Unavailable(f"worker {self.url} stream failed: {exc}") from None

    def decode(self, handle: KVHandle, first_token: int, max_tokens: int = 16,
               stop_token_ids: Sequence[int] | None = None, release: bool = True,
               sampling: m.SamplingParams | None = None) -> Iterator[m.TokenEvent]:
        req = m.DecodeRequest(handle=handle, first_token=first_token, max_tokens=max_tokens,
                              stop_token_ids=None if stop_token_ids is None else list(stop_token_ids),
                              release=release, sampling=sampling)
        return self._stream("/v1/decode", req)

    def generate(self, token_ids: Sequence[int], max_tokens: int = 16, request_id: str | None = None,
                 sampling: m.SamplingParams | None = None) -> Iterator[m.TokenEvent]:
        """Prefill and decode on this one worker (role `both` or `decode`)."""
        return self._stream("/v1/generate", m.GenerateRequest(token_ids=list(token_ids), max_tokens=max_tokens,
                                                             request_id=request_id, sampling=sampling))


@dataclass
class Generation:
    """One request through the disaggregated path."""

    request_id: str
    prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    ttft_ms: float = 0.0  # request sent -> first token in hand (prefill done, KV pushed)
    total_ms: float = 0.0
    cached_tokens: int = 0
    local_cached_tokens: int = 0
    pool_cached_tokens: int = 0
    computed_tokens: int = 0
    finish_reason: str | None = None

    def summary(self) -> dict:
        return {**asdict(self), "ttft_ms": round(self.ttft_ms, 2), "total_ms": round(self.total_ms, 2)}


def generate(prefill: WorkerClient, decode: WorkerClient, token_ids: Sequence[int], max_tokens: int = 16, *,
             request_id: str | None = None, on_text: Callable[[str], None] | None = None,
             retries: int = 1, sampling: m.SamplingParams | None = None) -> Generation:
    """Prefill on one worker, decode on another: the KV moves through the pool, by handle.

    If the decode worker cannot load the KV (evicted between the two calls, or damaged: the
    decode worker drops a damaged object), the request is prefilled again, which recomputes
    what is missing, up to `retries` times. Tokens already streamed are never retried.
    """
    started = time.perf_counter()
    base = request_id or uuid.uuid4().hex
    for attempt in range(retries + 1):
        rid = base if attempt == 0 else f"{base}-r{attempt}"
        head = prefill.prefill(token_ids, request_id=rid, sampling=sampling)
        gen = Generation(request_id=head.request_id, prompt_tokens=head.prompt_tokens,
                         token_ids=[head.first_token], text=head.text,
                         ttft_ms=(time.perf_counter() - started) * 1e3, cached_tokens=head.cached_tokens,
                         local_cached_tokens=head.local_cached_tokens, pool_cached_tokens=head.pool_cached_tokens,
                         computed_tokens=head.computed_tokens)
        try:
            events = decode.decode(head.handle, head.first_token, max_tokens, sampling=sampling)
            first = next(events)
        except (KeyNotFound, CorruptObject):
            if attempt == retries:
                raise
            continue
        if on_text is not None and head.text:
            on_text(head.text)
        for event in itertools.chain([first], events):
            if event.done:
                gen.finish_reason = event.finish_reason
                break
            gen.token_ids.append(event.token_id)
            gen.text += event.text
            if on_text is not None and event.text:
                on_text(event.text)
        gen.total_ms = (time.perf_counter() - started) * 1e3
        return gen
    raise AssertionError("unreachable")
