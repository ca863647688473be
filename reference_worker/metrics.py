"""Prometheus metrics of one worker (`GET /metrics`), in a registry of its own so several
workers in one process (tests) never collide.

Counters only go up; the load gauges are read from the live worker at scrape time.

Where a prompt's KV came from, per tenant ("" without one), in tokens and in chunk objects:
- `kvpool_cache_hit_tokens_total{source, tenant}`, source one of `SOURCES`: `worker` (this
  worker's own prefix cache), `pool_dram` / `pool_ssd` (the pool tier that served the chunk),
  `computed` (prefilled here). Per prefill the four add up to the prompt's length
  (`kvpool_lookup_tokens_total`); a fully cached prompt recomputes its last token, counted once,
  as computed.
- `kvpool_cache_hit_objects_total{source, tenant}`: full chunks by the same sources (`computed`:
  the full chunks no cache held); they add up to `kvpool_lookup_objects_total`.
- `kvpool_lookup_requests_total{tenant}`: prefills that looked their prompt up.
So the hit ratio is a PromQL division, e.g. over 5 minutes, all workers:
  sum(rate(kvpool_cache_hit_tokens_total{source!="computed"}[5m]))
    / sum(rate(kvpool_lookup_tokens_total[5m]))
"""

from __future__ import annotations

from typing import Any, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
SOURCES = ("worker", "pool_dram", "pool_ssd", "computed")


def prompt_sources(chunk_tokens: int, prompt: int, computed: int, full_chunks: int, local_chunks: int,
                   pool_tiers: list[str]) -> tuple[dict[str, int], dict[str, int]]:
    """(tokens, full chunks) of one prompt by source (`SOURCES`): `local_chunks` from the worker's
    cache, then one pool chunk per entry of `pool_tiers` (the tier that served it: "ssd", else
    DRAM: "" is a pool that does not say), the rest of the `full_chunks` computed. The tokens add
    up to `prompt`: a fully cached prompt recomputes its last token, counted once, as computed
    (taken from the source of the last cached chunk)."""
    ssd = sum(1 for t in pool_tiers if t == "ssd")
    chunks = {"worker": local_chunks, "pool_dram": len(pool_tiers) - ssd, "pool_ssd": ssd,
              "computed": full_chunks - local_chunks - len(pool_tiers)}
    tokens = {source: n * chunk_tokens for source, n in chunks.items()}
    tokens["computed"] = computed
    overlap = sum(tokens.values()) - prompt
    if overlap > 0:
        last = ("pool_ssd" if pool_tiers[-1] == "ssd" else "pool_dram") if pool_tiers else "worker"
        tokens[last] -= overlap
    return tokens, chunks


class WorkerMetrics:
    def __init__(self, role: str, worker: Any):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvpool_worker_requests", "Requests served, by kind", ["kind"], registry=r)
        self.prompt_tokens = Counter("kvpool_worker_prompt_tokens", "Prompt tokens by where their KV came from "
                                     "(local, pool, computed; kvpool_cache_hit_tokens_total splits the pool by tier)",
                                     ["source"], registry=r)
        self.hit_tokens = Counter("kvpool_cache_hit_tokens", "Prompt tokens by where their KV came from: worker "
                                  "(local prefix cache), pool_dram, pool_ssd, computed", ["source", "tenant"],
                                  registry=r)
        self.hit_objects = Counter("kvpool_cache_hit_objects", "Full prompt chunks by where their KV came from: "
                                   "worker, pool_dram, pool_ssd, computed", ["source", "tenant"], registry=r)
        self.lookups = Counter("kvpool_lookup_requests", "Prefills that looked their prompt up in the caches",
                               ["tenant"], registry=r)
        self.lookup_tokens = Counter("kvpool_lookup_tokens", "Prompt tokens looked up (the sum over sources of "
                                     "kvpool_cache_hit_tokens_total)", ["tenant"], registry=r)
        self.lookup_objects = Counter("kvpool_lookup_objects", "Full prompt chunks looked up (the sum over sources "
                                      "of kvpool_cache_hit_objects_total)", ["tenant"], registry=r)
        self.generated = Counter("kvpool_worker_generated_tokens", "Tokens produced by decode steps", registry=r)
        self.errors = Counter("kvpool_worker_errors", "Requests that failed, by error code", ["code"], registry=r)
        self.prefill_seconds = Histogram("kvpool_worker_prefill_seconds", "Prefill request latency (arrival to "
                                         "first token, KV pushed)", buckets=_LATENCY, registry=r)
        self.tbt_seconds = Histogram("kvpool_worker_time_between_tokens_seconds", "Time between streamed tokens",
                                     buckets=_LATENCY, registry=r)
        self.step_seconds = Histogram("kvpool_worker_decode_step_seconds", "One engine step with decode tokens "
                                      "(and the prefill chunk it carried, if any)", buckets=_LATENCY, registry=r)
        self.batch_size = Histogram("kvpool_worker_decode_batch_size", "Sequences per decode step",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.chunk_seconds = Histogram("kvpool_worker_prefill_chunk_seconds", "One engine step of prefill only",
                                       buckets=_LATENCY, registry=r)
        self.decode_kv_tokens = Counter("kvpool_worker_decode_kv_tokens", "KV tokens a decode loaded, by source",
                                        ["source"], registry=r)
        engine = lambda: worker.engine  # noqa: E731 - read at scrape time
        Gauge("kvpool_worker_queue_length", "Prefill jobs and decode sequences waiting", registry=r
              ).set_function(lambda: engine().queue_length)
        Gauge("kvpool_worker_active_sequences", "Sequences in the running decode batch", registry=r
              ).set_function(lambda: engine().active_sequences)
        Gauge("kvpool_worker_kv_tokens", "KV tokens held by running work", registry=r
              ).set_function(lambda: engine().kv_tokens())
        Gauge("kvpool_worker_local_cache_bytes", "Bytes in the local prefix cache", registry=r
              ).set_function(lambda: worker.cache.nbytes)
        Gauge("kvpool_worker_local_cache_tokens", "Tokens in the local prefix cache", registry=r
              ).set_function(lambda: worker.cache.tokens)
        Gauge("kvpool_worker_corrupt_chunks", "Damaged chunks found in the pool (recomputed)", registry=r
              ).set_function(lambda: worker.damaged_chunks)
        info = Gauge("kvpool_worker_info", "Worker role", ["role"], registry=r)
        info.labels(role=role).set(1)

    def prefill_done(self, tokens: Mapping[str, int], chunks: Mapping[str, int], seconds: float,
                     tenant: str | None = None) -> None:
        """One prefill: its prompt tokens and full chunks by source (keys of `SOURCES`)."""
        who = tenant or ""
        self.requests.labels(kind="prefill").inc()
        for source in SOURCES:
            self.hit_tokens.labels(source=source, tenant=who).inc(tokens.get(source, 0))
            self.hit_objects.labels(source=source, tenant=who).inc(chunks.get(source, 0))
        self.lookups.labels(tenant=who).inc()
        self.lookup_tokens.labels(tenant=who).inc(sum(tokens.get(s, 0) for s in SOURCES))
        self.lookup_objects.labels(tenant=who).inc(sum(chunks.get(s, 0) for s in SOURCES))
        self.prompt_tokens.labels(source="local").inc(tokens.get("worker", 0))
        self.prompt_tokens.labels(source="pool").inc(tokens.get("pool_dram", 0) + tokens.get("pool_ssd", 0))
        self.prompt_tokens.labels(source="computed").inc(tokens.get("computed", 0))
        self.prefill_seconds.observe(seconds)

    def decode_loaded(self, local_tokens: int, pool_tokens: int) -> None:
        self.decode_kv_tokens.labels(source="local").inc(local_tokens)
        self.decode_kv_tokens.labels(source="pool").inc(pool_tokens)

    def token_out(self, seconds: float) -> None:
        self.generated.inc()
        self.tbt_seconds.observe(seconds)

    def decode_done(self, tokens: int, seconds: float) -> None:
        self.requests.labels(kind="decode").inc()

    def decode_step(self, batch: int, seconds: float) -> None:
        self.step_seconds.observe(seconds)
        self.batch_size.observe(batch)

    def prefill_chunk(self, tokens: int, seconds: float) -> None:
        self.chunk_seconds.observe(seconds)

    def error(self, code: str) -> None:
        self.errors.labels(code=code).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
