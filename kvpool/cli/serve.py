"""`kvpool serve`: master + one store node in one process (embedded mode, the default)."""

from __future__ import annotations

import click

from kvpool.security.keyring import check_bind
from kvpool.cli.service_options import common_options, node_options, run_until_signal, settings_from
from kvpool.errors import InvalidArgument


@click.command()
@common_options
@node_options
@click.option("--admin-port", type=int, help="REST admin API port (0 disables).")
def serve(config_file, sets, **flags) -> None:
    """Run a whole pool in this process: clients connect with kvpool.connect("HOST:PORT").

    Prints "kvpool serving at HOST:PORT" once it accepts connections.
    """
    from kvpool.embedded import EmbeddedPool

    settings = settings_from(config_file, sets, **flags)
    # protected mode (kvpool.security.keyring)
    check_bind(settings.pool.host, bool(settings.security.auth_file), "kvpool serve")
    if settings.pool.meta:
        raise InvalidArgument("`kvpool serve` is the embedded mode (no etcd); for a cluster run "
                              "`kvpool master --meta ...` and `kvpool node --meta ...`")
    pool = EmbeddedPool(settings, admin=bool(settings.pool.admin_port)).start()
    run_until_signal(pool, f"kvpool serving at {pool.address}")
