"""Shared bits of `kvpool serve | master | node`: common options -> Settings, run until a signal."""

from __future__ import annotations

import signal
import threading
from typing import Any, Callable

import click

from kvpool.config import load_settings


def common_options(fn: Callable) -> Callable:
    opts = [
        click.option("--config", "config_file", type=click.Path(dir_okay=False), envvar="KVPOOL_CONFIG",
                     help="Settings file (JSON or TOML); KVPOOL_* variables and flags override it."),
        click.option("--host", help="Address to listen on (default 127.0.0.1)."),
        click.option("--port", type=int, help="Pool RPC port (0: any free port)."),
        click.option("--meta", help="etcd://host:port for cluster mode (default: none, standalone)."),
        click.option("--heartbeat-s", type=float, help="Heartbeat period in seconds."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def node_options(fn: Callable) -> Callable:
    opts = [
        click.option("--node-id", help="This node's id (default host:port)."),
        click.option("--dram-capacity", help="DRAM arena size, e.g. 4GiB."),
        click.option("--ssd-path", type=click.Path(file_okay=False), help="Directory of the SSD tier (lmdb)."),
        click.option("--ssd-capacity", help="SSD tier size, e.g. 64GiB."),
        click.option("--eviction", type=click.Choice(["lru", "s3fifo", "arc"]), help="Eviction policy."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def settings_from(config_file: str | None, **flags: Any):
    return load_settings(config_file, **flags)


def run_until_signal(service: Any, ready: str) -> None:
    """Print `ready` (tests and scripts wait for it), then serve until SIGINT/SIGTERM."""
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    click.echo(ready, nl=True)
    try:
        while not done.wait(0.5):
            pass
    finally:
        service.stop()
        click.echo("stopped", err=True)
