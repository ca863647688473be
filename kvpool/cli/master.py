"""`kvpool master`: a standalone master (metadata only); with --meta, a cluster master."""

from __future__ import annotations

import click

from kvpool.security.keyring import check_bind
from kvpool.cli.service_options import cluster_options, common_options, run_until_signal, settings_from


@click.command()
@common_options
@cluster_options
@click.option("--admin-port", type=int, help="REST admin API port (0 disables).")
def master(config_file, sets, **flags) -> None:
    """Run a master. With --meta etcd://HOST:PORT several masters elect a leader; the others stand by.

    Prints "kvpool master at HOST:PORT" once it accepts connections.
    """
    from kvpool.master.server import MasterServer

    settings = settings_from(config_file, sets, **flags)
    # protected mode (kvpool.security.keyring)
    check_bind(settings.pool.host, bool(settings.security.auth_file), "kvpool master")
    server = MasterServer(settings).start()
    handle = None
    if settings.pool.admin_port:
        from kvpool.admin.app import create_app
        from kvpool.admin.server import serve_in_thread

        try:
            handle = serve_in_thread(create_app(server.service.admin, settings), settings.pool.host,
                                     settings.pool.admin_port)
        except BaseException:  # e.g. a keyring but no admin token: nothing half started stays
            server.stop()
            raise
    run_until_signal(server, f"kvpool master at {server.address}", handle)
