"""Prometheus metrics for every kvpool service (`kvpool_` prefix), one registry per service.

- `ServiceMetrics`: a service's registry, with `kvpool_up{service, node}`.
- `StatsCollector`: reads the service's own `stats()` at scrape time and exposes it as
  `kvpool_tier_*{tier=...}` and `kvpool_pool_*`; nothing is copied between scrapes, so the
  numbers can never drift from what `/v1/stats` reports (and the hot path pays nothing).

Invariants: every metric name starts with `kvpool_`; a stats field whose name says it only
grows (hits, misses, evictions, bytes in/out, `*_total`) is a counter, anything else a gauge;
a scrape never raises (a failing `stats()` is logged and yields `kvpool_stats_up 0`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

PREFIX = "kvpool"
# Fields of a stats mapping that only ever grow; exposed as counters (`..._total`).
COUNTER_FIELDS = {"hits", "misses", "evictions", "bytes_in", "bytes_out", "puts", "gets", "removes",
                  "demotions", "promotions", "errors", "reads", "writes", "expired"}


def _name(*parts: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", "_".join(p for p in parts if p)).lower()


class ServiceMetrics:
    """One service's registry. `service` is "master" or "node"; `node_id` labels a node's
    `kvpool_up` so series from several nodes can be told apart in Prometheus."""

    def __init__(self, service: str, node_id: str | None = None):
        self.registry = CollectorRegistry()
        self.service = service
        up = Gauge(f"{PREFIX}_up", "1 while the service runs", ["service", "node"], registry=self.registry)
        up.labels(service=service, node=node_id or "").set(1)

    def watch_stats(self, stats: Callable[[], Mapping[str, Any]]) -> None:
        """Expose `stats()` (a mapping, see `StatsCollector`) at every scrape of this registry.
        Call it once per registry (merge sources into one callable): each collector exports
        `kvpool_stats_up`."""
        self.registry.register(StatsCollector(stats))

    def render(self) -> tuple[bytes, str]:
        return render(self.registry)


class StatsCollector(Collector):
    """Turns a stats mapping into metric families at scrape time.

    Understood shape (anything else is skipped): top-level numbers -> `kvpool_pool_<field>`;
    `tiers: {tier: {field: number}}` -> `kvpool_tier_<field>{tier}`; `nodes: {id: {..., tiers}}`
    or `nodes: [{"node_id"| "id": ..., ...}]` -> `kvpool_node_<field>{node}` and
    `kvpool_node_tier_<field>{node, tier}`. Objects with `to_dict()` / msgspec Structs are accepted.
    """

    def __init__(self, stats: Callable[[], Any]):
        self._stats = stats

    def describe(self) -> list:  # no describe-time call to stats(): it may not be ready yet
        return []

    def collect(self) -> Iterator:
        up = GaugeMetricFamily(f"{PREFIX}_stats_up", "1 if the last stats() call for this scrape succeeded")
        try:
            doc = to_builtins(self._stats())
        except Exception:  # a scrape must never take the service down
            log.exception("stats() failed during a metrics scrape")
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        families: dict[str, Any] = {}
        self._walk(families, doc, "pool", [], [])
        yield from families.values()

    def _walk(self, families: dict, doc: Any, scope: str, label_names: list[str], label_values: list[str],
              counters: bool = False, depth: int = 0) -> None:
        if not isinstance(doc, Mapping) or depth > 4:
            return
        for field, value in doc.items():
            field = str(field)
            if isinstance(value, bool):
                value = int(value)
            if isinstance(value, (int, float)):
                self._add(families, scope, field, label_names, label_values, value, counters)
            elif field == "tiers" and isinstance(value, Mapping):
                inner = "tier" if scope == "pool" else f"{scope}_tier"
                for tier, tdoc in value.items():
                    self._walk(families, tdoc, inner, label_names + ["tier"], label_values + [str(tier)],
                               counters, depth + 1)
            elif field == "nodes" and scope == "pool" and isinstance(value, (Mapping, list)):
                pairs = value.items() if isinstance(value, Mapping) else [
                    (n.get("node_id", n.get("id")), n) for n in value if isinstance(n, Mapping)]
                for node_id, ndoc in pairs:
                    self._walk(families, ndoc, "node", ["node"], [str(node_id)], counters, depth + 1)
            elif isinstance(value, Mapping):
                # "counters: {...}" holds totals that only grow; other sections become a name prefix
                nested = scope if field == "counters" else f"{scope}_{field}"
                self._walk(families, value, nested, label_names, label_values,
                           counters or field == "counters", depth + 1)

    @staticmethod
    def _add(families: dict, scope: str, field: str, names: list[str], values: list[str], value: float,
             counter: bool = False) -> None:
        is_counter = counter or field in COUNTER_FIELDS or field.endswith("_total")
        base = _name(PREFIX, scope, field.removesuffix("_total"))
        family = families.get(base)
        if family is None:
            cls = CounterMetricFamily if is_counter else GaugeMetricFamily
            family = families[base] = cls(base, f"{scope} {field} from stats()", labels=list(names))
        elif list(names) != list(family._labelnames):  # the same name with other labels would be invalid
            return
        family.add_metric(list(values), float(value))


# Per-tier counters the issue asks /v1/stats for; nodes report them (store.stats()), the master
# aggregates capacity and use. Filled in here only where the master's stats() lacks them.
_NODE_TIER_FIELDS = ("hits", "misses", "evictions", "bytes_in", "bytes_out")


def with_node_tiers(stats: dict[str, Any], nodes: list[dict[str, Any]]) -> dict[str, Any]:
    """`stats` (a master's) with each tier's hits, misses, evictions and bytes in/out summed over
    the nodes' own reports (their last heartbeat), unless the master already gives them."""
    tiers = stats.get("tiers")
    if not isinstance(tiers, dict):
        return stats
    sums: dict[str, dict[str, int]] = {}
    for node in nodes:
        reported = (node.get("stats") or {}).get("tiers") if isinstance(node, dict) else None
        for tier, doc in (reported or {}).items():
            if not isinstance(doc, dict):
                continue
            acc = sums.setdefault(tier, dict.fromkeys(_NODE_TIER_FIELDS, 0))
            for field in _NODE_TIER_FIELDS:
                value = doc.get(field)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    acc[field] += value
    for tier, acc in sums.items():
        target = tiers.setdefault(tier, {})
        for field, value in acc.items():
            target.setdefault(field, value)
    return stats


def master_samples(stats: dict[str, Any], nodes: list[dict[str, Any]]) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample a master's /metrics derives from its `stats()` and
    `nodes()` (the same names: `kvpool_tier_*`, `kvpool_node_stats_tier_*`, ...), for a caller
    that reads them over the pool RPC (the router's dashboard) instead of scraping."""
    doc = {**with_node_tiers(to_builtins(stats), to_builtins(nodes)), "nodes": to_builtins(nodes)}
    return [(s.name, dict(s.labels), float(s.value))
            for family in StatsCollector(lambda: doc).collect() for s in family.samples]


def to_builtins(obj: Any) -> Any:
    """Plain JSON-able data from dicts, msgspec Structs, dataclasses, pydantic models, enums."""
    import msgspec

    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json")
    if hasattr(obj, "to_dict") and callable(obj.to_dict):
        obj = obj.to_dict()
    return msgspec.to_builtins(obj, str_keys=True, enc_hook=_enc_hook)


def _enc_hook(obj: Any) -> Any:
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json")
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return bytes(obj).hex()
    return str(obj)


def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The Prometheus text exposition of `registry` and its content type."""
    return generate_latest(registry), CONTENT_TYPE_LATEST


def serve_metrics(registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0,
                  token: str | None = None) -> Any:
    """Serve `registry` at http://host:port/metrics from a daemon thread (for store nodes, which
    have no admin app); port 0 picks a free one. `token`: the bearer token every scrape must
    present (what a Prometheus scrape config's `authorization: {credentials_file: ...}` sends),
    else 401 with `WWW-Authenticate: Bearer` and no metric; None: open. Returns the
    `kvpool.admin.server.ServerHandle` (`.url`, `.stop()`)."""
    from prometheus_client import make_asgi_app

    from kvpool.admin.server import serve_in_thread
    from kvpool.security.http_guard import HttpGuard

    app = HttpGuard(make_asgi_app(registry), token=lambda: token, what="this node's /metrics",
                    needs_token=lambda path: True)
    return serve_in_thread(app, host, port)
