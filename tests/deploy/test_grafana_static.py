"""The Grafana dashboard and its wiring, statically: one dashboard JSON (deploy/grafana), the same
bytes in the Kubernetes ConfigMap, provisioned in the compose stack's "monitoring" profile, and a
Prometheus configuration that scrapes every kvpool service there. That each metric the dashboard
queries is exported by a running process is tests/e2e/test_dashboards.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvpool-dashboard.json"
COMPOSE = ROOT / "deploy" / "docker-compose.yml"


def exprs(doc: dict) -> list[str]:
    return [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]


def test_dashboard_is_grafana_json_with_the_panels_the_issue_names():
    doc = json.loads(DASHBOARD.read_text())
    assert doc["uid"] and doc["schemaVersion"] >= 36
    titles = {p["title"] for p in doc["panels"]}
    for wanted in ("Prompt-token hit ratio", "Prompt tokens by source", "Tier occupancy", "Evictions",
                   "Tier throughput", "Queue and running batch", "Decode batch size", "TTFT",
                   "TPOT (time between tokens)", "Routing decisions"):
        assert wanted in titles, wanted
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    for p in doc["panels"]:
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
    for e in exprs(doc):
        assert e.count("(") == e.count(")") and re.search(r"\bkvpool_\w+", e), e


def test_the_k8s_configmap_holds_the_same_dashboard():
    docs = [d for d in yaml.safe_load_all((ROOT / "deploy" / "k8s" / "monitoring.yaml").read_text()) if d]
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "kvpool-grafana-dashboards")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["kvpool.json"]) == json.loads(DASHBOARD.read_text())
    grafana = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "kvpool-grafana")
    volumes = {v["name"]: v for v in grafana["spec"]["template"]["spec"]["volumes"]}
    assert volumes["dashboards"]["configMap"]["name"] == "kvpool-grafana-dashboards"


def test_compose_provisions_grafana_and_scrapes_every_service():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    grafana, prometheus = services["grafana"], services["prometheus"]
    assert grafana["profiles"] == prometheus["profiles"] == ["monitoring"]
    mounts = dict(v.rsplit(":", 1)[0].split(":") for v in grafana["volumes"])
    for source in mounts:
        assert (COMPOSE.parent / source).exists(), source
    assert mounts["./grafana/kvpool-dashboard.json"] == "/etc/grafana/dashboards/kvpool.json"
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/kvpool.yaml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/etc/grafana/dashboards"
    datasource = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/kvpool.yaml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"

    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    kvpool = {name for name, svc in services.items() if svc.get("image", "kvpool:local") == "kvpool:local"}
    assert {t.split(":")[0] for t in targets} == kvpool, (targets, kvpool)
    for job in config["scrape_configs"]:  # a secret the container mounts, where the service wants one
        auth = job.get("authorization")
        if auth:
            assert auth["credentials_file"].removeprefix("/run/secrets/") in prometheus["secrets"]
    assert "/prometheus" in prometheus["tmpfs"] and "/var/lib/grafana" in grafana["tmpfs"]
