"""Prometheus metrics: the master's /metrics mirrors stats(); node-side helpers serve a registry."""

from __future__ import annotations

import re

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvpool.admin.metrics import ServiceMetrics, StatsCollector, serve_metrics


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_master_metrics_endpoint_mirrors_stats(master, admin):
    _, c = admin
    r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = _samples(r.text)
    assert all(name.startswith("kvpool_") for name, _ in samples)
    assert samples[("kvpool_stats_up", ())] == 1
    assert samples[("kvpool_pool_objects", ())] == 3
    assert samples[("kvpool_tier_capacity_bytes", (("tier", "dram"),))] == 64 << 20
    assert samples[("kvpool_tier_used_bytes", (("tier", "dram"),))] == 6000
    assert samples[("kvpool_node_used_bytes", (("node", "node-a"),))] == 6000
    assert ("kvpool_pool_puts_total", ()) in samples
    # a change in the master shows in the next scrape
    master.admin.evict(keys=["key-0"])
    samples = _samples(c.get("/metrics").text)
    assert samples[("kvpool_pool_objects", ())] == 2
    assert samples[("kvpool_pool_evictions_total", ())] >= 1


def test_metrics_need_no_token(admin):
    _, c = admin
    assert c.get("/metrics").status_code == 200


def test_service_metrics_up():
    m = ServiceMetrics("node", "n7")
    s = _samples(m.render()[0].decode())
    assert s[("kvpool_up", (("node", "n7"), ("service", "node")))] == 1


def test_stats_collector_shapes_and_counters():
    doc = {"objects": 5, "tiers": {"dram": {"capacity": 100, "used": 40, "hits": 7, "misses": 2, "evictions": 1,
                                             "bytes_in": 10, "bytes_out": 20}, "ssd": {"capacity": 1000, "used": 0}},
           "counters": {"put_bytes": 99}, "name": "not a number"}
    m = ServiceMetrics("node", "n1")
    m.watch_stats(lambda: doc)
    text = m.render()[0].decode()
    s = _samples(text)
    assert s[("kvpool_tier_hits_total", (("tier", "dram"),))] == 7
    assert s[("kvpool_tier_bytes_out_total", (("tier", "dram"),))] == 20
    assert s[("kvpool_tier_used", (("tier", "ssd"),))] == 0
    assert s[("kvpool_pool_put_bytes_total", ())] == 99
    assert re.search(r"# TYPE kvpool_tier_hits(_total)? counter", text)
    assert "# TYPE kvpool_tier_used gauge" in text


def test_failing_stats_never_breaks_a_scrape():
    def broken():
        raise RuntimeError("stats exploded")

    m = ServiceMetrics("master")
    m.watch_stats(broken)
    s = _samples(m.render()[0].decode())
    assert s[("kvpool_stats_up", ())] == 0
    assert s[("kvpool_up", (("node", ""), ("service", "master")))] == 1


def test_node_side_metrics_server():
    m = ServiceMetrics("node", "n2")
    m.watch_stats(lambda: {"tiers": {"dram": {"used": 12}}})
    server = serve_metrics(m.registry, "127.0.0.1", 0)
    try:
        s = _samples(httpx.get(server.url, timeout=5).text)
        assert s[("kvpool_tier_used", (("tier", "dram"),))] == 12
    finally:
        server.stop()


def test_collector_accepts_structs_and_dataclasses():
    import dataclasses

    import msgspec

    class Tier(msgspec.Struct):
        used: int
        hits: int

    @dataclasses.dataclass
    class Doc:
        tiers: dict

    from prometheus_client import CollectorRegistry, generate_latest

    reg = CollectorRegistry()
    reg.register(StatsCollector(lambda: Doc(tiers={"dram": Tier(used=3, hits=4)})))
    s = _samples(generate_latest(reg).decode())
    assert s[("kvpool_tier_hits_total", (("tier", "dram"),))] == 4


def test_master_metrics_survive_a_failing_stats(master, admin, monkeypatch):
    _, c = admin

    def broken():
        raise RuntimeError("stats down")

    monkeypatch.setattr(master.admin, "stats", broken)
    r = c.get("/metrics")
    assert r.status_code == 200
    assert _samples(r.text)[("kvpool_stats_up", ())] == 0
    monkeypatch.undo()
    assert _samples(c.get("/metrics").text)[("kvpool_stats_up", ())] == 1
