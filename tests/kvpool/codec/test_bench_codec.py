"""`kvpool bench codec` end to end on the reference model (few prompts and tokens): one result per
codec in the shared shape, `none` exactly equal to the uncompressed run, the lossy codec at the
bytes it states (no accuracy or speed threshold asserted here: BENCHMARKS.md has the full run)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.model


def test_bench_codec_json(tmp_path):
    pytest.importorskip("transformers")
    from reference_worker.model import is_cached

    if not is_cached():
        pytest.skip("the reference model is not installed/converted")
    out = subprocess.run(
        [sys.executable, "-c", "from kvpool.cli import main; main()", "--log-level", "WARNING", "bench", "codec",
         "--json", "--prompts", "2", "--new-tokens", "4", "--reps", "1", "--codecs", "int8", "--threads", "1"],
        capture_output=True, text=True, timeout=600, check=True)
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["bench"] == "codec"
    by_case = {r["case"]: r for r in doc["results"]}
    assert set(by_case) == {"none", "int8"}
    none, int8 = by_case["none"]["extra"], by_case["int8"]["extra"]
    assert none["token_agreement"] == 1.0 and none["token_agreement_to_first_divergence"] == 1.0
    assert none["logit_max_abs_diff"] == 0.0 and none["kv_rel_rms_error_k"] == 0.0
    assert none["bytes_vs_bf16"] == 2.0  # float32 KV
    assert int8["bytes_vs_bf16"] == pytest.approx(0.5098, abs=1e-4)
    assert 0 < int8["kv_rel_rms_error_k"] < 0.02 and 0 < int8["logit_max_abs_diff"]
    assert 0 <= int8["token_agreement"] <= 1 and int8["encode_gbps"] > 0 and int8["decode_gbps"] > 0
    assert by_case["int8"]["baseline"] == "none" and by_case["int8"]["unit"] == "fraction"
