"""`kvpool bench flood` runs end to end (a small flood, few operations) and ends with the shared
JSON shape: every tenant operation measured quiet and flooded, none failed. Speed is not
asserted here (the figures are in the report)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from kvpool.tools.launch.processes import clean_env


def test_bench_flood_smoke():
    env = clean_env()
    r = subprocess.run(
        [str(Path(sys.executable).with_name("kvpool")), "bench", "flood", "--json", "--reps", "1", "--ops", "5",
         "--connects", "2", "--connections", "200", "--settle-s", "0"],
        capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert doc["bench"] == "flood" and doc["setup"]["connections"] == 200
    cases = {x["case"] for x in doc["results"]}
    assert cases == {f"{path}/{op}_p99" for path in ("rpc", "engine") for op in ("connect", "put", "get")}
    for x in doc["results"]:
        assert x["unit"] == "ms" and x["baseline"] == "quiet" and x["value"] > 0 and x["baseline_value"] > 0
        assert x["extra"]["failed"] == 0 and x["extra"]["failed_quiet"] == 0
