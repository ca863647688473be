"""Shared bits of the product commands: `--config` and `--set` (the configuration tree, with each
command's own options as flags over it), the pool commands' common options, run until a signal."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any, Callable

import click

from kvpool.cli import LOG_FLAG
from kvpool.config import CONFIG_ENV, Settings, load_settings, use_settings


def _apply(opts: list, fn: Callable) -> Callable:
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def config_options(fn: Callable) -> Callable:
    """`--config FILE` and `--set SECTION.FIELD=VALUE`: every setting of the tree, for any command."""
    return _apply([
        click.option("--config", "config_file", type=click.Path(dir_okay=False), envvar=CONFIG_ENV,
                     help="Configuration file (TOML or JSON; docs/configuration.md). KVPOOL_* variables and "
                          "flags override it."),
        click.option("--set", "sets", multiple=True, metavar="SECTION.FIELD=VALUE",
                     help="Any setting of the tree, over the file and the environment, e.g. --set "
                          "worker.max_batch=16 (repeatable; `kvpool config show` lists them)."),
    ], fn)


def common_options(fn: Callable) -> Callable:
    """`kvpool serve | master | node`."""
    return _apply([
        config_options,
        click.option("--host", help="Address to listen on (default 127.0.0.1)."),
        click.option("--port", type=int, help="Pool RPC port (0: any free port)."),
    ], fn)


def cluster_options(fn: Callable) -> Callable:
    """`kvpool master | node`."""
    return _apply([
        click.option("--meta", help="etcd://HOST:PORT for cluster mode (default: none, standalone)."),
        click.option("--heartbeat-s", type=float, help="Heartbeat period in seconds (default 1)."),
    ], fn)


def node_options(fn: Callable) -> Callable:
    return _apply([
        click.option("--dram-capacity", help="DRAM arena size, e.g. 4GiB."),
        click.option("--ssd-path", type=click.Path(file_okay=False), help="Directory of the SSD tier (lmdb)."),
        click.option("--ssd-capacity", help="SSD tier size, e.g. 64GiB."),
        click.option("--eviction", type=click.Choice(["lru", "s3fifo", "arc"]), help="Eviction policy."),
    ], fn)


def settings_from(config_file: str | None, sets: tuple[str, ...] = (), **flags: Any) -> Settings:
    """The tree for this command (file < environment < `flags` < `--set`), made this process's
    (`kvpool.config.use_settings`), its log level applied unless `--log-level` chose one."""
    settings = load_settings(config_file, sets=sets, **flags)
    use_settings(settings)
    if LOG_FLAG["level"] is None:
        logging.getLogger().setLevel(settings.log_level)
    return settings


def run_until_signal(service: Any, ready: str, http: Any = None) -> None:
    """Print `ready` (tests and scripts wait for it), then serve until SIGINT/SIGTERM; `http`, the
    service's HTTP server (a `kvpool.admin.ServerHandle`), if any, is stopped first."""
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    click.echo(ready, nl=True)
    try:
        while not done.wait(0.5):
            pass
    finally:
        if http is not None:
            http.stop()
        service.stop()
        click.echo("stopped", err=True)
