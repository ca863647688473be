"""Prometheus metrics of one worker (`GET /metrics`), in a registry of its own so several
workers in one process (tests) never collide.

Counters only go up; the load gauges are read from the live worker at scrape time.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class WorkerMetrics:
    def __init__(self, role: str, worker: Any):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvpool_worker_requests", "Requests served, by kind", ["kind"], registry=r)
        self.prompt_tokens = Counter("kvpool_worker_prompt_tokens", "Prompt tokens by where their KV came from",
                                     ["source"], registry=r)
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

    def prefill_done(self, prompt: int, local: int, pool: int, computed: int, seconds: float) -> None:
        self.requests.labels(kind="prefill").inc()
        self.prompt_tokens.labels(source="local").inc(local)
        self.prompt_tokens.labels(source="pool").inc(pool)
        self.prompt_tokens.labels(source="computed").inc(computed)
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
