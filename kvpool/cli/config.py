"""`kvpool config show`: the configuration tree in effect, each value with where it came from."""

from __future__ import annotations

import click

from kvpool.cli.service_options import config_options, settings_from


@click.group()
def config() -> None:
    """The configuration every command reads: a file, KVPOOL_* variables, flags (docs/configuration.md)."""


@config.command()
@config_options
def show(config_file, sets) -> None:
    """Print the configuration in effect as TOML (usable as a --config file), each value with its origin:
    default, the file, a KVPOOL_* variable (named) or a flag. Secrets are never printed."""
    from kvpool.config import describe

    click.echo(describe(settings_from(config_file, sets)))
