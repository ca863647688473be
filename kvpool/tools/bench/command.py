"""`kvpool bench <name>`: every benchmark, by name. Each measures our figure and its baseline in
the same run (`kvpool.tools.bench.report`); `--json` ends the output with one JSON line.

Every benchmark lives in `kvpool.tools.bench` (which, as a tool, may import the adapters and the
reference worker). A benchmark module is imported only when it runs.
"""

from __future__ import annotations

import importlib

import click

# bench name -> "module:attribute" (a click command)
BENCHES: dict[str, str] = {
    "adapter": "kvpool.tools.bench.adapter:adapter",
    "codec": "kvpool.tools.bench.codec:codec",
    "disagg": "kvpool.tools.bench.disagg:disagg",
    "engine": "kvpool.tools.bench.engine:engine",
    "flood": "kvpool.tools.bench.flood:flood",
    "kvevents": "kvpool.tools.bench.kvevents:kvevents",
    "lmcache": "kvpool.tools.bench.lmcache_remote:lmcache",
    "overhead": "kvpool.tools.bench.overhead:overhead",
    "policies": "kvpool.tools.bench.policies:policies",
    "presets": "kvpool.tools.workload_file:presets",
    "pool": "kvpool.tools.bench.pool:pool",
    "router": "kvpool.tools.bench.router:router",
    "serve": "kvpool.tools.bench.serve:serve",
    "store": "kvpool.tools.bench.store:store",
    "transfer": "kvpool.tools.bench.transfer:transfer",
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
    """Benchmarks with same-run baselines; `--json` ends the output with one JSON line.

    The load of serve, disagg, engine, pool and policies comes from `--workload NAME|FILE` (a
    preset or a TOML/YAML file; `kvpool bench presets` lists them), `--set KEY=VALUE`, and a few
    flags that override the file."""
