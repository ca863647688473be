"""The dashboards against real processes of the deployed shape (compose, k8s): every metric the
Grafana dashboard (deploy/grafana/kvpool-dashboard.json) queries is exported by a running master,
node, worker or router; and the router's built-in page (GET /dashboard), loaded in a real headless
Chromium, runs without a console error and shows the workers' live counters.

KVPOOL_DASHBOARD_SCREENSHOT=docs/dashboard.png writes the page's screenshot there."""

from __future__ import annotations

import json
import os
import random
import re
import threading
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpool.security.local import local_token

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
    # as a scraper of this user's pool: the master's and node's /metrics take the user's own metrics
    # token (the default, kvpool.security.local); the router's and workers' are open on loopback
    scraper = {"authorization": f"Bearer {local_token('metrics')}"}
    pages = {name: httpx.get(url, timeout=30, headers=scraper) for name, url in pages.items()}
    assert httpx.get(deployed.node_metrics, timeout=30).status_code == 401  # without the token: refused
    assert all(r.status_code == 200 for r in pages.values()), {n: r.status_code for n, r in pages.items()}
    return {name: r.text for name, r in pages.items()}


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


# ---- the built-in page, in a real headless Chromium ---------------------------------------------

def _traffic(router_url: str, prefill_url: str, rounds: int) -> None:
    """Streamed completions through the router that share prefixes (worker-cache hits), with the
    prefill worker's cache cleared between rounds (pool hits)."""
    from reference_worker.client import WorkerClient

    model = httpx.get(f"{router_url}/v1/models", timeout=30).json()["data"][0]["id"]
    words = "harbour ship pilot buoy north river bridge signal anchor island".split()
    with WorkerClient(prefill_url) as prefill, httpx.Client(timeout=300) as http:
        for i in range(rounds):
            rng = random.Random(i % 2)
            prompt = f"Section {i % 2}. " + " ".join(rng.choice(words) for _ in range(500))
            body = {"model": model, "prompt": prompt, "max_tokens": 6, "stream": True}
            with http.stream("POST", f"{router_url}/v1/completions", json=body) as r:
                assert r.status_code == 200
                for _ in r.iter_lines():
                    pass
            if i % 3 == 2:
                prefill.clear_cache()


def test_the_builtin_dashboard_shows_live_numbers_without_errors(deployed, tmp_path):
    from headless_chromium import Chromium, chromium_binary

    if chromium_binary() is None:
        pytest.skip("chromium is not installed (apt-get install chromium; `make test` installs it)")
    c = deployed.cluster
    _traffic(c.router_url, c.url("prefill"), 2)
    with Chromium(tmp_path) as browser:
        page = browser.open(f"{c.router_url}/dashboard", until="Number(document.body.dataset.polls) >= 1")
        polls = lambda: page.evaluate("Number(document.body.dataset.polls)")  # noqa: E731
        worker = threading.Thread(target=_traffic, args=(c.router_url, c.url("prefill"), 9))
        worker.start()
        worker.join()
        seen = polls()
        assert page.wait(f"Number(document.body.dataset.polls) >= {seen + 2}", 60)  # a snapshot after the last request

        assert page.errors == []
        status = page.evaluate("document.getElementById('status').textContent")
        assert status.startswith("4 of 4 sources"), status  # router, two workers, the pool
        tiles = page.evaluate("Object.fromEntries([...document.querySelectorAll('.tile')]"
                              ".map(e => [e.dataset.tile, e.querySelector('.v').textContent]))")
        points = page.evaluate("Object.fromEntries([...document.querySelectorAll('.panel')]"
                               ".map(e => [e.dataset.panel, Number(e.dataset.points)]))")
        if os.environ.get("KVPOOL_DASHBOARD_SCREENSHOT"):
            Path(os.environ["KVPOOL_DASHBOARD_SCREENSHOT"]).write_bytes(page.screenshot())

    # The live numbers are the workers' own counters (no traffic since the last snapshot).
    want: dict[str, float] = {}
    for url in (c.url("prefill"), c.url("decode")):
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
            for s in family.samples:
                if s.name in ("kvpool_cache_hit_tokens_total", "kvpool_lookup_tokens_total"):
                    key = s.labels.get("source", "lookup")
                    want[key] = want.get(key, 0) + s.value
    for source in ("worker", "pool_dram", "pool_ssd", "computed"):
        assert tiles[f"tokens_{source}"] == _shown(want[source]), (source, tiles, want)
    assert want["worker"] > 0 and want["pool_dram"] > 0 and want["computed"] > 0
    assert tiles["hit_ratio"] == f"{100 * (1 - want['computed'] / want['lookup']):.1f}%"
    assert tiles["workers_up"] == "2" and int(tiles["requests"]) >= 11
    assert re.fullmatch(r"\d+\.\d%", tiles["dram_used"]), tiles
    for panel in ("hit-ratio", "tokens-by-source", "tier-occupancy", "tier-throughput", "queue", "ttft", "tpot",
                  "decisions"):
        assert points[panel] > 0, (panel, points)


def _shown(v: float) -> str:
    """A count as the page prints it (fmt() in dashboard.html)."""
    if abs(v) >= 1e6:
        return f"{v / 1e6:.1f}M"
    if abs(v) >= 1e4:
        return f"{v / 1e3:.1f}k"
    return str(int(v))
