"""`kvpool node`: a store node that joins a master (--master HOST:PORT) or a cluster (--meta)."""

from __future__ import annotations

import logging

import click

from kvpool.errors import InvalidArgument, Unavailable
from kvpool.security.keyring import check_bind
from kvpool.cli.service_options import (cluster_options, common_options, node_options, run_until_signal,
                                        settings_from)

log = logging.getLogger(__name__)


@click.command()
@common_options
@cluster_options
@node_options
@click.option("--node-id", help="This node's id (default host:port).")
@click.option("--master", help="The master's HOST:PORT (standalone); with --meta the leader is found in etcd.")
@click.option("--admin-port", type=int, help="Port of this node's Prometheus /metrics (0: none); with a keyring it "
              "needs KVPOOL_METRICS_TOKEN_FILE.")
def node(config_file, sets, **flags) -> None:
    """Run a store node: its tiers, its RPC port, heartbeats to the master, /metrics.

    Prints "kvpool node ID at HOST:PORT" once it serves.
    """
    from kvpool.node import StoreNode

    settings = settings_from(config_file, sets, **flags)
    pool, security = settings.pool, settings.security
    check_bind(pool.host, bool(security.auth_file), "kvpool node")  # protected mode (kvpool.security.keyring)
    if pool.admin_port and security.auth_file and not security.metrics_token:
        raise InvalidArgument(
            f"kvpool node: a keyring is set ({security.auth_file}) but /metrics (port {pool.admin_port}) has no "
            "token, so anyone who reaches it would read this node's traffic and use. Give it one in a file: "
            "KVPOOL_METRICS_TOKEN_FILE=metrics.token (`kvpool auth init` writes one; Prometheus presents it as a "
            "bearer token), or serve no /metrics (--admin-port 0).")
    store_node = StoreNode(settings).start()
    metrics = None
    if pool.admin_port:
        from kvpool.admin.metrics import ServiceMetrics, serve_metrics

        m = ServiceMetrics("node", store_node.node_id)
        m.watch_stats(store_node.store.stats)
        try:
            token = security.metrics_token
            if token is None and not security.auth_file:  # no configuration: the user's own (kvpool.security.local)
                from kvpool.security.local import local_token

                token = local_token("metrics")
            metrics = serve_metrics(m.registry, pool.host, pool.admin_port, token=token)
        except (OSError, Unavailable) as exc:  # a busy port must not keep the node's data from serving
            log.warning("node %s: /metrics not served on port %d: %s", store_node.node_id, pool.admin_port, exc)
    run_until_signal(store_node, f"kvpool node {store_node.node_id} at {store_node.rpc.address}", metrics)
