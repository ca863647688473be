"""Limits on the options of every `kvpool` command (issue 26: the product commands keep few
options; the benches, the simulator and chaos take a workload file or preset instead of dozens of
flags). The table: `python -m kvpool.tools.scripts.cli_options` (or pytest -s here).
"""

from __future__ import annotations

from kvpool.tools.scripts.cli_options import count_options

PRODUCT_COMMANDS = ("serve", "master", "node", "router", "worker", "up", "generate", "admin")
WORKLOAD_COMMANDS = ("bench serve", "bench disagg", "bench engine", "bench pool", "bench policies", "sim",
                     "sim plan", "sim study", "chaos")


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
