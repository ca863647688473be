"""The architecture check: the import contracts in pyproject.toml ([tool.importlinter]) hold.

`transfer` imports nothing of ours; `kvpool` does not import `engine_adapters` except its CLI;
no module of `kvpool` imports a layer above its own (the layers follow ../shared/DESIGN.md).
A broken contract fails here with import-linter's report: which import, in which file and line.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    if not lint.exists():
        lint = shutil.which("lint-imports")
    assert lint, "lint-imports is missing: install the dev extra (pip install -e '.[dev]'; `make test` does)"
    proc = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    report = proc.stdout[proc.stdout.find("Contracts"):] if "Contracts" in proc.stdout else proc.stdout
    assert proc.returncode == 0, f"import contracts broken (lint-imports exit {proc.returncode}):\n{report}\n{proc.stderr}"
    assert "KEPT" in proc.stdout, f"lint-imports checked no contract:\n{proc.stdout}"
