"""The options of every `kvpool` command (issue 26: the product commands keep few options; the
benches, the simulator and chaos take a workload file or preset instead of dozens of flags).

    python tests/test_cli_options.py [--json]     (or pytest -s: the table is printed)

Walks the click tree, the lazy groups included (which imports every command module), and counts
one line per command: its options (--help not counted). A group with options of its own (`kvpool
sim`) is a line too.
"""

from __future__ import annotations

import json
import sys

import click


PRODUCT_COMMANDS = ("serve", "master", "node", "router", "worker", "up", "generate", "admin")
WORKLOAD_COMMANDS = ("bench serve", "bench disagg", "bench engine", "bench pool", "bench policies", "sim",
                     "sim plan", "sim study", "chaos")


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


def test_the_workload_commands_keep_few_options():
    counts = count_options()
    print()
    for path, n in sorted(counts.items()):
        print(f"{n:4d}  kvpool {path}")
    for command in WORKLOAD_COMMANDS:
        assert counts[command] <= 18, (command, counts[command])  # bench serve had 40, sim 26
    assert sum(counts[c] for c in WORKLOAD_COMMANDS) <= 90  # 171 before issue 26
    assert counts["bench presets"] == 0


def test_the_product_commands_keep_few_options():
    """Every other setting is `--set SECTION.FIELD=VALUE`, a KVPOOL_* variable or the file (one tree)."""
    counts = count_options()
    for command in PRODUCT_COMMANDS:
        assert counts[command] <= 16, (command, counts[command])  # up and worker had 20
    assert sum(counts[c] for c in PRODUCT_COMMANDS) <= 86  # 96 before issue 26


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
