"""`kvpool bench <name>`: every benchmark, by name. Each measures our figure and its baseline in
the same run (`kvpool.bench.report`); `--json` ends the output with one JSON line.

The pool's own benchmarks live in `kvpool.bench`; those that need an engine or start reference
workers live with the adapters, in `engine_adapters.bench` (the CLI is the one part of kvpool
that may reach up into engine_adapters). A benchmark module is imported only when it runs.
"""

from __future__ import annotations

import importlib

import click

# bench name -> "module:attribute" (a click command)
BENCHES: dict[str, str] = {
    "adapter": "engine_adapters.bench.adapter:adapter",
    "codec": "engine_adapters.bench.codec:codec",
    "disagg": "engine_adapters.bench.disagg:disagg",
    "engine": "engine_adapters.bench.engine:engine",
    "overhead": "engine_adapters.bench.overhead:overhead",
    "policies": "engine_adapters.bench.policies:policies",
    "pool": "kvpool.bench.pool:pool",
    "router": "engine_adapters.bench.router:router",
    "serve": "kvpool.bench.serve:serve",
    "store": "kvpool.bench.store:store",
    "transfer": "kvpool.bench.transfer:transfer",
}


class _LazyBench(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(BENCHES)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = BENCHES.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)


@click.group(cls=_LazyBench)
def bench() -> None:
    """Benchmarks with same-run baselines; `--json` ends the output with one JSON line."""
