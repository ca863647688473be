"""The dashboards against real processes: every metric the Grafana dashboard
(deploy/grafana/kvpool-dashboard.json) queries is exported by a running master, node, worker or
router of the deployed shape (compose, k8s)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.model, pytest.mark.timeout(900)]

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvpool-dashboard.json"
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("_sum", "_count", "_created"), "gauge": ("",), "info": ("_info",)}


def exported_names(text: str) -> set[str]:
    """Every series name a scrape of this page gives Prometheus, also for families that have no
    sample yet (a labelled counter nobody incremented: declared, so the query is right)."""
    names = set()
    for family in text_string_to_metric_families(text):
        names |= {s.name for s in family.samples}
        names |= {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
    return names


def queried_names() -> set[str]:
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
    return {name for e in exprs for name in re.findall(r"\bkvpool_[a-zA-Z0-9_]+", e)}


@pytest.fixture(scope="module")
def scraped(deployed):
    """The /metrics pages of the master, the node, both workers and the router, after a request
    through the router (so its histograms and the workers' hit counters have samples)."""
    c = deployed.cluster
    model = httpx.get(f"{c.router_url}/v1/models", timeout=30).json()["data"][0]["id"]
    r = httpx.post(f"{c.router_url}/v1/completions", timeout=300,
                   json={"model": model, "prompt": "The harbour office opens at", "max_tokens": 4})
    assert r.status_code == 200, r.text
    pages = {"master": f"{deployed.master_admin}/metrics", "node": deployed.node_metrics,
             "prefill": f"{c.url('prefill')}/metrics", "decode": f"{c.url('decode')}/metrics",
             "router": f"{c.router_url}/metrics"}
    return {name: httpx.get(url, timeout=30).text for name, url in pages.items()}


def test_every_metric_the_grafana_dashboard_queries_is_exported(scraped):
    exported = set().union(*(exported_names(text) for text in scraped.values()))
    queried = queried_names()
    assert len(queried) >= 20
    missing = sorted(queried - exported)
    assert not missing, f"the dashboard queries metrics no process exports: {missing}"
    # the check can fail: a counter's family name is not a series Prometheus stores
    assert "kvpool_cache_hit_tokens" not in exported and "kvpool_cache_hit_tokens_total" in exported
    # the pool tier panels read the leader master's per-node view, which has both tiers of the node
    assert 'kvpool_node_stats_tier_used{node="node-a",tier="ssd"}' in scraped["master"]
