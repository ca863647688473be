"""`kvpool bench <name>`: benchmarks that measure our figure and its baseline in the same run.

See `report.py` for the shared shape (alternating repetitions, median, spread, JSON last line).
"""

from __future__ import annotations

import importlib

import click

# bench name -> "module:attribute" (a click command)
BENCHES: dict[str, str] = {
    "adapter": "kvpool.bench.adapter:adapter",
    "pool": "kvpool.bench.pool:pool",
    "policies": "kvpool.bench.cluster:policies",
    "disagg": "kvpool.bench.cluster:disagg",
    "router": "kvpool.bench.router:router",
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
