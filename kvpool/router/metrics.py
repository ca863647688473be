"""Prometheus metrics of the router (`GET /metrics`), in a registry of its own.

Besides request counts and latencies it exports the signal an autoscaler needs: how pressed each
side is (`kvpool_router_pressure{side}`: the prefill side's estimated queue wait over the TTFT
target, the decode side's estimated time between tokens over the TBT target) and which side is
the bottleneck (`kvpool_router_bottleneck{side}` is 1 for the more pressed side).
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class RouterMetrics:
    def __init__(self, pressure: Callable[[], dict[str, float]],
                 workers: Callable[[], dict[tuple[str, str], int]]):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kvpool_router_requests", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("kvpool_router_ttft_seconds", "Request arrival to first token sent",
                              buckets=_LATENCY, registry=r)
        self.e2e = Histogram("kvpool_router_e2e_seconds", "Request arrival to last token sent",
                             buckets=_LATENCY, registry=r)
        self.route = Histogram("kvpool_router_route_seconds", "Template, tokenize, hash, match, choose",
                               buckets=_LATENCY, registry=r)
        self.decisions = Counter("kvpool_router_decisions", "Routing decisions by kind", ["policy", "kind"],
                                 registry=r)
        self.prompt_tokens = Counter("kvpool_router_prompt_tokens", "Prompt tokens, cached or computed",
                                     ["source"], registry=r)
        self.completion_tokens = Counter("kvpool_router_completion_tokens", "Tokens generated", registry=r)
        self.rejected = Counter("kvpool_router_rejected", "Requests refused by admission (429)", registry=r)
        self.retries = Counter("kvpool_router_retries", "Requests retried on another worker", ["stage"],
                               registry=r)
        self.worker_failures = Counter("kvpool_router_worker_failures", "Worker calls that failed", ["stage"],
                                       registry=r)
        self._pressure = pressure
        self._workers = workers
        press = Gauge("kvpool_router_pressure", "Estimated load over target, per side (>1: over target)",
                      ["side"], registry=r)
        bottleneck = Gauge("kvpool_router_bottleneck", "1 for the side that limits throughput now", ["side"],
                           registry=r)
        count = Gauge("kvpool_router_workers", "Workers by role and status", ["role", "status"], registry=r)
        self._gauges = (press, bottleneck, count)

    def render(self) -> bytes:
        press, bottleneck, count = self._gauges
        values = self._pressure()
        for side, value in values.items():
            press.labels(side=side).set(value)
        worst = max(values, key=values.get) if values and max(values.values()) > 0 else None
        for side in values:
            bottleneck.labels(side=side).set(1 if side == worst else 0)
        count.clear()
        for (role, status), n in self._workers().items():
            count.labels(role=role, status=status).set(n)
        return generate_latest(self.registry)

    def done(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()
