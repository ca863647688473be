"""The cluster as the router sees it, in metric samples: for `GET /dashboard/data` (the built-in
dashboard) and `GET /admin/stats` (`kvpool admin stats --router`), where no Prometheus runs.

`snapshot(router)` reads, at the moment it is asked:
- the router's own registry (`kvpool_router_*`);
- each worker the router knows (`/metrics`, concurrently, `timeout_s` each): `kvpool_worker_*`,
  `kvpool_cache_hit_*`, `kvpool_lookup_*`;
- the pool, over the router's pool client (the master's `stats` and `nodes`), under the names the
  master's own /metrics uses (`kvpool.admin.metrics.master_samples`): `kvpool_tier_*`,
  `kvpool_node_stats_tier_*`, ...
The names are the Prometheus names, so the dashboard page and deploy/grafana share their queries.

Invariants: a snapshot never raises; a source that cannot be read is listed with `ok: false` and
its error (one line), and contributes no samples.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, Awaitable, Iterable

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvpool.admin.metrics import master_samples
from kvpool.router.backends.base import get

log = logging.getLogger(__name__)

Sample = tuple[str, dict[str, str], float]
SOURCES = ("worker", "pool_dram", "pool_ssd", "computed")  # reference_worker.metrics.SOURCES


def parse(text: str) -> list[Sample]:
    """The samples of a Prometheus text page (NaN and +Inf kept as floats)."""
    return [(s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(text) for s in family.samples]


async def snapshot(router: Any, timeout_s: float = 2.0) -> dict[str, Any]:
    """{"t": unix seconds, "sources": [{"name", "kind", "ok", "error", "samples"}]}."""
    started = time.time()
    sources = [await _read("router", "router", _router(router))]
    workers = list(router.workers.by_url.values()) if router.workers is not None else []
    reads = [_read(w.name, "worker", _worker(router.backend.http, w.url, w.name, timeout_s), url=w.url)
             for w in workers]
    if router.pool is not None:
        reads.append(_read("pool", "pool", _pool(router.pool, timeout_s)))
    sources += await asyncio.gather(*reads)
    for source in sources:  # JSON has no NaN or infinity (a gauge may be NaN)
        source["samples"] = [s for s in source["samples"] if math.isfinite(s[2])]
    return {"t": started, "sources": sources}


async def _read(name: str, kind: str, samples: Awaitable[list[Sample]], **extra: str) -> dict[str, Any]:
    head = {"name": name, "kind": kind, **extra}
    try:
        return {**head, "ok": True, "error": "", "samples": await samples}
    except Exception as exc:  # a page must show what it could read
        return {**head, "ok": False, "error": _one_line(exc), "samples": []}


async def _router(router: Any) -> list[Sample]:
    return parse(router.metrics.render().decode())


async def _worker(http: aiohttp.ClientSession, url: str, name: str, timeout_s: float) -> list[Sample]:
    samples = parse((await get(http, url, "/metrics", timeout_s)).decode())
    for _, labels, _ in samples:
        labels["worker"] = name
    return samples


async def _pool(matcher: Any, timeout_s: float) -> list[Sample]:
    client = matcher.pool  # the PrefixMatcher's asyncio client
    stats, nodes = await asyncio.wait_for(asyncio.gather(client.admin("stats"), client.admin("nodes")), timeout_s)
    return master_samples(stats, nodes)


def _one_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"[:300]


def samples_of(snap: dict[str, Any], kind: str | None = None) -> Iterable[Sample]:
    for source in snap["sources"]:
        if kind is None or source["kind"] == kind:
            yield from (tuple(s) for s in source["samples"])


def hit_summary(snap: dict[str, Any]) -> dict[str, Any]:
    """Hit rates from a snapshot: prompt tokens and chunks by source (summed over workers), per
    tenant, and the pool's tiers' own hit rates (reads a tier served / reads that reached it)."""
    total = _hit_totals()
    tenants: dict[str, dict[str, Any]] = {}
    for name, labels, value in samples_of(snap, "worker"):
        what = _HIT_NAMES.get(name)
        if what is None:
            continue
        for acc in (total, tenants.setdefault(labels.get("tenant", ""), _hit_totals())):
            if what in ("tokens", "objects"):
                if labels.get("source") in acc[what]:
                    acc[what][labels["source"]] += value
            else:
                acc[what] += value
    tiers: dict[str, dict[str, float]] = {}
    for name, labels, value in samples_of(snap, "pool"):
        if name.startswith("kvpool_tier_") and "tier" in labels:
            field = name.removeprefix("kvpool_tier_").removesuffix("_total")
            tiers.setdefault(labels["tier"], {})[field] = int(value) if value.is_integer() else value
    for doc in tiers.values():
        reads = doc.get("hits", 0) + doc.get("misses", 0)
        doc["hit_rate"] = doc.get("hits", 0) / reads if reads else None
    return {"prompt": _hit_doc(total), "tenants": {t: _hit_doc(acc) for t, acc in sorted(tenants.items())},
            "pool_tiers": tiers,
            "sources": [{k: s.get(k) for k in ("name", "kind", "ok", "error")} for s in snap["sources"]]}


_HIT_NAMES = {"kvpool_cache_hit_tokens_total": "tokens", "kvpool_cache_hit_objects_total": "objects",
              "kvpool_lookup_tokens_total": "lookup_tokens", "kvpool_lookup_objects_total": "lookup_objects",
              "kvpool_lookup_requests_total": "requests"}


def _hit_totals() -> dict[str, Any]:
    return {"tokens": dict.fromkeys(SOURCES, 0.0), "objects": dict.fromkeys(SOURCES, 0.0),
            "lookup_tokens": 0.0, "lookup_objects": 0.0, "requests": 0.0}


def _hit_doc(acc: dict[str, Any]) -> dict[str, Any]:
    doc = {k: {s: int(n) for s, n in v.items()} if isinstance(v, dict) else int(v) for k, v in acc.items()}
    looked = acc["lookup_tokens"]
    doc["hit_ratio"] = (looked - acc["tokens"]["computed"]) / looked if looked else None
    return doc
