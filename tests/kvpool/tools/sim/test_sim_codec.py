"""`kvpool sim --set kv_codec=CODEC`: a codec's bytes ratio shrinks every pool block, so the same DRAM holds
more of the trace and the prefix hit ratio can only rise (LRU on a fixed trace)."""

from __future__ import annotations

import json
import subprocess
import sys

KVPOOL = [sys.executable, "-c", "from kvpool.cli import main; main()"]


def _sim(trace_path, codec: str) -> dict:
    res = subprocess.run([*KVPOOL, "sim", "--trace", str(trace_path), "--set", "limit=600", "--colocated", "4",
                          "--dram", "16GiB", "--set", "goodput_steps=0", "--set", f"kv_codec={codec}", "--json"],
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_int8_raises_the_hit_ratio_at_a_fixed_dram_size(trace_path):
    plain, int8 = _sim(trace_path, "none"), _sim(trace_path, "int8")
    assert plain["kv_codec"] == "none" and plain["kv_bytes_ratio"] == 1.0
    assert int8["kv_codec"] == "int8" and 0.5 <= int8["kv_bytes_ratio"] <= 0.52  # bf16 KV, head dim 128
    assert int8["hit_ratio"] > plain["hit_ratio"], (int8["hit_ratio"], plain["hit_ratio"])
    assert int8["hit_ratio"] <= int8["reuse_upper_bound"]["hit_ratio"] == plain["reuse_upper_bound"]["hit_ratio"]


def test_an_unknown_codec_is_a_clear_error(trace_path):
    res = subprocess.run([*KVPOOL, "sim", "--trace", str(trace_path), "--set", "limit=10", "--colocated", "1",
                          "--set", "kv_codec=zip9"], capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "unknown KV codec 'zip9'" in res.stderr and "Traceback" not in res.stderr
