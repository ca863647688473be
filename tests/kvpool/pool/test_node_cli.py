"""`kvpool node` serves Prometheus /metrics on --admin-port, and accepts --eviction arc."""

from __future__ import annotations

import httpx
from etcd_testing import spawn

from kvpool.tools.launch.processes import free_port


def test_node_serves_metrics_with_its_store_stats():
    master = spawn(["master", "--port", "0", "--admin-port", "0", "--heartbeat-s", "0.2"])
    try:
        port = free_port()
        node = spawn(["node", "--port", "0", "--master", master.address, "--node-id", "metrics-node",
                      "--dram-capacity", "8MiB", "--eviction", "arc", "--admin-port", str(port)])
        try:
            from kvpool.security.local import local_token

            url = f"http://127.0.0.1:{port}/metrics"
            assert httpx.get(url, timeout=10).status_code == 401  # unconfigured: the user's own metrics token
            text = httpx.get(url, timeout=10, headers={"Authorization": f"Bearer {local_token('metrics')}"}).text
            assert 'kvpool_up{node="metrics-node",service="node"} 1.0' in text
            assert "kvpool_stats_up" in text and "8.388608e+06" in text  # the DRAM capacity, from store.stats
        finally:
            node.stop()
    finally:
        master.stop()
