"""The options of every `kvpool` command, one line each (issue 26: the product commands keep few
options; the benches, the simulator and chaos take a workload file or preset instead of flags).

    python -m kvpool.tools.scripts.cli_options [--json]

Walks the click tree, the lazy groups included (which imports every command module), and counts
one line per command: its options (--help not counted). A group with options of its own (`kvpool
sim`) is a line too. tests/test_cli_options.py holds the limits.
"""

from __future__ import annotations

import json
import sys

import click


def count_options(root: click.Command | None = None) -> dict[str, int]:
    """command path ("bench serve") -> number of options."""
    if root is None:
        from kvpool.cli import cli as root
    out: dict[str, int] = {}

    def walk(cmd: click.Command, path: list[str], parent: click.Context | None) -> None:
        n = sum(isinstance(p, click.Option) for p in cmd.params)
        if path and (n or not isinstance(cmd, click.Group)):
            out[" ".join(path)] = n
        if isinstance(cmd, click.Group):
            ctx = click.Context(cmd, info_name=path[-1] if path else "kvpool", parent=parent)
            for name in cmd.list_commands(ctx):
                sub = cmd.get_command(ctx, name)
                if sub is not None:
                    walk(sub, [*path, name], ctx)

    walk(root, [], None)
    return out


def main() -> None:
    counts = count_options()
    if "--json" in sys.argv[1:]:
        print(json.dumps(counts))
        return
    for path, n in sorted(counts.items()):
        print(f"{n:4d}  kvpool {path}")
    print(f"{sum(counts.values()):4d}  options in {len(counts)} commands")


if __name__ == "__main__":
    main()
