"""`make gpu-check` must work the first time it meets a GPU: run its code path on the CPU here."""

from __future__ import annotations

import json

import pytest

from kvpool.tools.bench import gpu_check



def test_cpu_dry_run_emits_the_bench_json(capsys):
    assert gpu_check.main(["--device", "cpu", "--quick", "--no-tests"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["bench"] == "gpu"
    cases = {(r["case"], r["size"]) for r in doc["results"]}
    for case in ("torch_h2d_pinned", "torch_d2h_pinned"):
        assert {(case, 64 << 10), (case, 1 << 20)} <= cases
    assert all(r["value"] > 0 and r["ratio"] is not None for r in doc["results"])


@pytest.mark.skipif(gpu_check.cuda_unavailable_reason() is None, reason="this machine has CUDA")
def test_without_cuda_it_skips_cleanly(capsys):
    assert gpu_check.main([]) == 0
    assert "gpu-check skipped:" in capsys.readouterr().out
