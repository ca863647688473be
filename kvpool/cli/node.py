"""`kvpool node`: a store node that joins a master (--master HOST:PORT) or a cluster (--meta)."""

from __future__ import annotations

import click

from kvpool.cli._service import common_options, node_options, run_until_signal, settings_from


@click.command()
@common_options
@node_options
@click.option("--master", help="The master's HOST:PORT (standalone); with --meta the leader is found in etcd.")
def node(config_file, **flags) -> None:
    """Run a store node: its tiers, its RPC port, heartbeats to the master.

    Prints "kvpool node ID at HOST:PORT" once it serves.
    """
    from kvpool.node import StoreNode

    settings = settings_from(config_file, **flags)
    store_node = StoreNode(settings).start()
    run_until_signal(store_node, f"kvpool node {store_node.node_id} at {store_node.rpc.address}")
