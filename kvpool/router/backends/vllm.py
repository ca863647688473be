"""The router in front of vLLM OpenAI servers that run the kvpool connector (`--engine vllm`).

The reference workers speak kvpool's own worker API (`/v1/prefill`, `/v1/decode`, `/load`, ...);
a vLLM server speaks the OpenAI API. This backend gives the router what it needs from such a
server, and runs a routed request on it, the way vLLM's own disaggregation proxy does:

    prefill:  POST /v1/completions on the prefill instance (kv_producer) with the prompt's token
              ids, max_tokens=1, no stream, and kv_transfer_params {"do_remote_decode": true, ...};
              its connector writes the prompt's full chunks to the pool while it computes them
    decode:   POST /v1/completions on the decode instance (kv_consumer) with the same token ids,
              the whole token budget, stream=true, and the kv_transfer_params the prefill answer
              carried; its connector loads the chunks from the pool, so it computes only the tail,
              and streams every token (the prefill's one token is not sent: vLLM's proxy drops it too)

Routing facts come from elsewhere than the worker API: the tokenizer and the KV layout from the
model folder (`--tokenizer PATH`: tokenizer.json, tokenizer_config.json, config.json), the chunk
key namespace from the connector settings the servers were given (`--kv-connector-config`), the
model name and context length from `GET /v1/models`, load from `GET /metrics` (requests running and
waiting, KV cache use, the mean time between tokens since the last poll). What each server's own
prefix cache holds comes from its KV events on ZMQ (`--kv-events`, kv_events.py), where the router
is told where they are published; without them only the pool's `match_prefix` counts.

Tenants (API keys mapped to tenants, tenants.py): a vLLM server takes no tenant header and holds
one pool credential, so a tenant's request carries vLLM's own `cache_salt` (`Tenant.cache_salt`,
derived from the tenant's salt) on both the prefill and the decode request: vLLM salts its own
prefix cache with it, and the connector its chunk keys' namespace, so tenants never share either.

`usage.prompt_tokens_details.cached_tokens` is what the decode instance reports (start it with
`--enable-prompt-tokens-details`): the prompt tokens it did not compute, i.e. those it loaded from
the pool (or found in its own prefix cache), as the client would see it behind vLLM's proxy.

Its HTTP client is its own aiohttp session, without kvpool's internal token (a vLLM server has
its own --api-key). Invariants: every request counted in flight on a worker is uncounted exactly
once; a failure before the decode stream sent anything is raised as the retryable `BeforeFirst`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvpool import worker_api as wire
from kvpool.errors import InvalidArgument, Unavailable
from kvpool.keys import Namespace
from kvpool.chunk_format import KVLayout
from kvpool.codec import stored_bytes_per_token
from kvpool.config import current_settings
from kvpool.router.backends.base import (POLL_TIMEOUT_S, BeforeFirst, Outcome, Piece, Request, client_session,
                                         failed, get, unreachable)

if TYPE_CHECKING:
    from kvpool.router.service import Router
    from kvpool.router.policy import Decision
    from kvpool.router.workers import WorkerState

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "both")
# What vLLM's own proxy sends a prefill instance: "decode elsewhere, keep nothing for me".
PREFILL_KV_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                     "remote_block_ids": None, "remote_host": None, "remote_port": None}
_DTYPES = {"float32": "float32", "float": "float32", "float16": "float16", "half": "float16",
           "bfloat16": "bfloat16"}


@dataclass
class VLLMSettings:
    """What the router must know about vLLM servers that it cannot ask them."""

    model_path: str  # the model folder the servers load: tokenizer, chat template, config.json
    connector: dict[str, Any] = field(default_factory=dict)  # their kv_connector_extra_config
    kv_dtype: str | None = None  # vLLM's --dtype; default: what `--dtype auto` picks from config.json
    max_batch: int = 256  # vLLM's --max-num-seqs

    def namespace(self, served_root: str) -> tuple[Namespace, int]:
        """The connector's chunk key namespace (TP rank 0) and chunk size, computed as the
        connector computes it from vLLM's config (engine_adapters/vllm: ConnectorSettings)."""
        cfg = _read_json(Path(self.model_path) / "config.json")
        heads = int(cfg["num_attention_heads"])
        # vLLM's `--dtype auto`: the config's dtype, float32 downcast to bfloat16 (GPU and x86 CPU)
        dtype = self.kv_dtype or str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").removeprefix("torch.")
        dtype = "bfloat16" if dtype in ("float32", "float") and not self.kv_dtype else dtype
        if dtype not in _DTYPES:
            raise InvalidArgument(f"KV dtype {dtype!r} is not one of {sorted(_DTYPES)}")
        settings = current_settings()  # the connector fills what its extra config leaves out from the same tree
        chunk = int(self.connector.get("chunk_tokens", settings.pool.chunk_tokens))
        layout = KVLayout(num_layers=int(self.connector.get("num_layers", cfg["num_hidden_layers"])),
                          kv_heads=int(self.connector.get("kv_heads", cfg.get("num_key_value_heads", heads))),
                          head_dim=int(self.connector.get("head_dim", cfg.get("head_dim") or cfg["hidden_size"] // heads)),
                          dtype=_DTYPES[dtype], chunk_tokens=chunk,
                          codec=str(self.connector.get("kv_codec", settings.pool.kv_codec)))  # as the connector's
        ns = Namespace(str(self.connector.get("model_id", served_root)),
                       str(self.connector.get("weights_fingerprint", settings.connector.weights_fingerprint)), layout,
                       tenant_salt=str(self.connector.get("tenant_salt", "")))
        return ns, chunk

    def tokenizer_info(self, model_id: str) -> wire.TokenizerInfo:
        """The tokenizer as the worker API's `TokenizerInfo`, read from the model folder."""
        folder = Path(self.model_path)
        tok_json = folder / "tokenizer.json"
        if not tok_json.is_file():
            raise InvalidArgument(f"{folder} has no tokenizer.json (give the model folder with --tokenizer)")
        conf = _read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
        template = conf.get("chat_template")
        if template is None and (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        specials = {k: _token_text(v) for k, v in conf.items()
                    if k.endswith("_token") and isinstance(_token_text(v), str)}
        text = tok_json.read_text()
        bos = specials.get("bos_token")
        return wire.TokenizerInfo(model_id=model_id, tokenizer_json=text, chat_template=template, bos_token=bos,
                                  eos_token=specials.get("eos_token"),
                                  add_bos_token=bool(conf.get("add_bos_token")) and not _adds_bos(text, bos),
                                  special_tokens=specials)


class VLLMBackend:
    """Registration, load polling and request execution against vLLM OpenAI servers."""

    engine = "vllm"
    registers_itself = False  # a vLLM server never registers itself: the router keeps asking
    tenant_header = False  # tenants go by cache_salt
    kv_events = True  # where told (--kv-events), their KV events come by ZMQ (kv_events.py)

    def __init__(self, settings: VLLMSettings):
        self.settings = settings
        self.http: aiohttp.ClientSession | None = None
        self._tokenizer: wire.TokenizerInfo | None = None
        self._itl: dict[str, tuple[float, float]] = {}  # url -> (sum, count) of vllm:inter_token_latency

    async def start(self) -> None:
        self.http = client_session({})

    async def close(self) -> None:
        if self.http is not None:
            await self.http.close()

    # -- what the router learns at registration ---------------------------------------------------
    async def describe(self, url: str, role: str | None) -> wire.WorkerInfo:
        role = role or "both"
        if role not in ROLES:
            raise InvalidArgument(f"worker role must be one of {ROLES}, got {role!r}")
        body = await get(self.http, url, "/v1/models", 10.0)
        try:
            card = json.loads(body)["data"][0]
            served, root, context = str(card["id"]), str(card.get("root") or card["id"]), int(card.get("max_model_len") or 0)
        except (KeyError, IndexError, TypeError, ValueError):
            raise Unavailable(f"{url}/v1/models lists no model: is it a vLLM OpenAI server?") from None
        ns, chunk = self.settings.namespace(root)
        cfg = _read_json(Path(self.settings.model_path) / "config.json")
        eos = cfg.get("eos_token_id")
        if self._tokenizer is None:
            self._tokenizer = self.settings.tokenizer_info(served)
        return wire.WorkerInfo(role=role, model_id=served, namespace=ns.hex(), chunk_tokens=chunk,
                               dtype=ns.layout.dtype, pool=str(self.settings.connector.get("kvpool_address", "")),
                               eos_token_ids=eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [],
                               max_positions=context, bytes_per_token=ns.layout.bytes_per_token,
                               kv_codec=ns.layout.codec, stored_bytes_per_token=stored_bytes_per_token(ns.layout),
                               namespace_doc=ns.canonical_json())

    async def tokenizer(self, url: str) -> wire.TokenizerInfo:
        """Read from the model folder (a vLLM server has no /v1/tokenizer)."""
        if self._tokenizer is None:
            raise Unavailable("no vLLM server has registered yet")
        return self._tokenizer

    async def poll(self, state: WorkerState) -> tuple[wire.LoadReport, None]:
        """Load from vLLM's Prometheus metrics (`/metrics`); its KV events, if any, come by kv_events.py."""
        page = await get(self.http, state.url, "/metrics", POLL_TIMEOUT_S)
        try:
            m = parse_metrics(page.decode(errors="replace"))
        except ValueError as exc:  # (a poll fails in the router's terms)
            raise Unavailable(f"worker {state.url}: its /metrics is not Prometheus text ({exc})") from None
        capacity = int(m.get("cache_blocks", 0) * m.get("block_size", 0))
        itl_ms = 0.0
        total = (m.get("vllm:inter_token_latency_seconds_sum", 0.0), m.get("vllm:inter_token_latency_seconds_count", 0.0))
        before = self._itl.get(state.url)
        if before is not None and total[1] > before[1]:  # the mean over the tokens since the last poll
            itl_ms = 1e3 * (total[0] - before[0]) / (total[1] - before[1])
        self._itl[state.url] = total
        waiting = int(m.get("vllm:num_requests_waiting", 0))
        running = int(m.get("vllm:num_requests_running", 0))
        return wire.LoadReport(role=state.role, queue_length=waiting, active_sequences=running,
                               kv_tokens=int(m.get("vllm:kv_cache_usage_perc", 0.0) * capacity), cache_tokens=0,
                               cache_capacity_tokens=capacity, max_batch=self.settings.max_batch,
                               decode_token_ms=itl_ms / max(1, running)), None  # a step of the batch it ran

    # -- execution ------------------------------------------------------------------------------
    async def run(self, host: Router, d: "Decision", req: Request, out: Outcome) -> AsyncIterator[Piece]:
        """Prefill on `d.prefill` (if any), then stream the decode from `d.decode`."""
        kv_params = None
        if d.prefill is not None:
            kv_params = await self._prefill(host, host.workers.by_name(d.prefill), req, d)
        decoder = host.workers.by_name(d.decode)
        local = d.prefill is None
        uncached = len(req.ids) - d.cached_tokens
        if local:  # the decode instance computes the uncached part itself
            decoder.prefill_sent(uncached)
        decoder.decode_sent()
        try:
            async for piece in self._decode(host, decoder, req, kv_params, out):
                yield piece
        finally:
            decoder.decode_done()
            if local:
                decoder.prefill_done(uncached)

    def _body(self, worker: "WorkerState", req: Request, max_tokens: int, **extra: Any) -> dict[str, Any]:
        """A /v1/completions body for `req`, with its tenant's cache_salt, if any."""
        sampling, tenant = req.sampling, req.tenant
        salt = {"cache_salt": tenant.cache_salt} if tenant is not None and tenant.cache_salt else {}
        return {"model": worker.info.model_id, "prompt": req.ids, "max_tokens": max_tokens, "temperature":
                sampling.temperature, "top_p": sampling.top_p, "seed": sampling.seed, **salt, **extra}

    async def _prefill(self, host: Router, p: WorkerState, req: Request,
                       d: Decision) -> dict[str, Any] | None:
        ids, rid = req.ids, req.request_id
        uncached = len(ids) - d.cached_tokens
        p.prefill_sent(uncached)
        sent = time.perf_counter()
        try:
            body = await self._post(host, p, self._body(p, req, 1, stream=False,
                                                          kv_transfer_params=dict(PREFILL_KV_PARAMS)), rid)
        finally:
            p.prefill_done(uncached)
            p.served += 1
        elapsed = time.perf_counter() - sent
        usage = body.get("usage") or {}
        cached = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
        host.cost.observe_prefill(len(ids) - cached, cached, elapsed, 0, 0.0)
        host.metrics.prompt_tokens.labels(source="computed").inc(len(ids) - cached)
        params = body.get("kv_transfer_params")
        log.debug("request %s: prefilled on %s in %.0f ms, kv_transfer_params %s", rid, p.name, elapsed * 1e3, params)
        return params if isinstance(params, dict) else None

    async def _post(self, host: Router, worker: WorkerState, body: dict[str, Any],
                    rid: str) -> dict[str, Any]:
        try:
            async with self.http.post(worker.url + "/v1/completions", json=body, headers={"X-Request-Id": rid}) as resp:
                raw, status = await resp.read(), resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise unreachable(host, worker, "/v1/completions", exc, streamed=False) from None
        if status >= 400:
            raise self._error(host, worker, status, raw)
        try:
            return json.loads(raw)
        except ValueError:
            raise BeforeFirst(worker.name, Unavailable(f"worker {worker.name} sent a body that is not JSON")) from None

    async def _decode(self, host: Router, worker: WorkerState, req: Request, kv_params: dict[str, Any] | None,
                      out: Outcome) -> AsyncIterator[Piece]:
        extra: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}}
        if kv_params:
            extra["kv_transfer_params"] = kv_params
        body = self._body(worker, req, req.max_tokens, **extra)
        got_any, finish = False, None
        try:
            async with self.http.post(worker.url + "/v1/completions", json=body,
                                      headers={"X-Request-Id": req.request_id}) as resp:
                if resp.status >= 400:
                    raise self._error(host, worker, resp.status, await resp.read())
                async for line in resp.content:  # server-sent events: "data: {...}" lines
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk or chunk.get("object") == "error":
                        raise failed(worker.name, Unavailable(f"worker {worker.name}: {_message(chunk)}"), got_any)
                    if chunk.get("usage"):
                        _account(out, chunk["usage"])
                    for choice in chunk.get("choices") or ():
                        text = choice.get("text") or ""
                        finish = choice.get("finish_reason") or finish
                        if text:
                            got_any = True
                            yield Piece(text)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise unreachable(host, worker, "/v1/completions", exc, got_any) from None
        host.metrics.prompt_tokens.labels(source="cached").inc(out.cached_tokens)
        yield Piece(finish=finish or "stop")

    def _error(self, host: Router, worker: "WorkerState", status: int, raw: bytes) -> Exception:
        try:
            message = _message(json.loads(raw))
        except ValueError:
            message = raw[:200].decode(errors="replace")
        if status < 500:  # the request itself is wrong (vLLM validated it): no retry elsewhere
            return InvalidArgument(f"{worker.name}: {message}")
        host.metrics.worker_failures.labels(stage="completions").inc()
        return BeforeFirst(worker.name, Unavailable(f"worker {worker.name} answered {status}: {message}"))


def _account(out: Outcome, usage: dict[str, Any]) -> None:
    out.completion_tokens = int(usage.get("completion_tokens") or 0)
    out.cached_tokens = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)


def _message(doc: Any) -> str:
    err = doc.get("error", doc) if isinstance(doc, dict) else doc
    return str(err.get("message", err)) if isinstance(err, dict) else str(err)


def parse_metrics(text: str) -> dict[str, float]:
    """Each vLLM metric in Prometheus text, summed over its label sets, plus `block_size` and
    `cache_blocks` read from the labels of `vllm:cache_config_info`."""
    out: dict[str, float] = {}
    for name, labels, value, *_ in (s for fam in text_string_to_metric_families(text) for s in fam.samples):
        if not name.startswith("vllm:"):
            continue
        out[name] = out.get(name, 0.0) + value
        blocks = labels.get("num_gpu_blocks") or labels.get("num_cpu_blocks") or ""
        if name == "vllm:cache_config_info" and labels.get("block_size", "").isdigit() and blocks.isdigit():
            out["block_size"], out["cache_blocks"] = float(labels["block_size"]), float(blocks)
    return out


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"cannot read {path}: {exc}") from None


def _token_text(value: Any) -> Any:
    return value.get("content") if isinstance(value, dict) else value


def _adds_bos(tokenizer_json: str, bos: str | None) -> bool:
    """Does the tokenizer JSON's own post-processor already prepend BOS?"""
    if bos is None:
        return False
    import tokenizers

    tok = tokenizers.Tokenizer.from_str(tokenizer_json)
    ids = tok.encode("Hello").ids
    return bool(ids) and ids[0] == tok.token_to_id(bos)


__all__ = ["VLLMBackend", "VLLMSettings", "parse_metrics", "PREFILL_KV_PARAMS"]
