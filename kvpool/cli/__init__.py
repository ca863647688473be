"""The `kvpool` command line. Thin: parse, call the library, format.

Each command lives in its own module and is imported only when used, so `kvpool keys` starts in
milliseconds and does not load torch. The tools' commands (bench, sim, chaos, soak) live with
their tools in `kvpool.tools`, named below by import path.
"""

from __future__ import annotations

import importlib
import logging
import sys

import click

from kvpool.errors import KVPoolError

# command name -> "module:attribute"
COMMANDS: dict[str, str] = {
    "admin": "kvpool.cli.admin:admin",
    "auth": "kvpool.cli.auth:auth",
    "keys": "kvpool.cli.keys:keys",
    "bench": "kvpool.tools.bench.command:bench",
    "serve": "kvpool.cli.serve:serve",
    "master": "kvpool.cli.master:master",
    "node": "kvpool.cli.node:node",
    "worker": "kvpool.cli.worker:worker",
    "generate": "kvpool.cli.generate:generate",
    "up": "kvpool.cli.up:up",
    "router": "kvpool.cli.router:router",
    "sim": "kvpool.tools.sim.command:sim",
    "chaos": "kvpool.tools.chaos.command:chaos",
    "soak": "kvpool.tools.chaos.soak_command:soak",
    "config": "kvpool.cli.config:config",
}


LOG_FLAG: dict[str, str | None] = {"level": None}  # `kvpool --log-level`, which beats the tree's log_level


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="kvpool")
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
              help="Over the configuration's log_level (KVPOOL_LOG_LEVEL; default INFO).")
def cli(log_level: str | None) -> None:
    """kvpool: a distributed KV-cache pool for LLM serving (prefill/decode disaggregation).

    Start with `kvpool up` (a local cluster with the reference model) or `kvpool serve`
    (a pool: master + one node in one process). Every command reads one configuration tree
    (a file, KVPOOL_* variables, flags): `kvpool config show` prints it.
    """
    # a command that loads the tree applies its log_level then, unless this flag chose one
    LOG_FLAG["level"] = log_level = log_level.upper() if log_level else None
    logging.basicConfig(level=log_level or "INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if log_level != "DEBUG":  # httpx logs every request at INFO: noise around a bench's progress bar
        logging.getLogger("httpx").setLevel(logging.WARNING)


def main() -> None:
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except KVPoolError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
