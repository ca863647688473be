"""`kvpool bench pool --netns` end to end (slow: it builds a delay line, starts a pool in another
namespace, and measures): a link of 1 ms round trip and 10 Gbit/s between two namespaces, ours
against a raw socket store over the same link and the link's rate. Speed is not asserted, only
that every system was measured over that link, correctness held (the bench checks every value
it reads) and nothing of the fabric is left behind. Needs root and iproute2/nftables."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.tools.netns import unavailable
from kvpool.tools.launch.processes import clean_env

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(unavailable() is not None, reason=f"no namespace fabric here: {unavailable()}")]


def _namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


@pytest.mark.timeout(900)
def test_bench_pool_across_a_1ms_10gbit_link():
    env = clean_env()
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("kvpool")), "bench", "pool", "--workload", "netns",
         "--json", "--reps", "3", "--sizes", "64KiB,1MiB", "--set", "bytes_per_rep=2MiB", "--set", "batch=8"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    out, err = proc.communicate(timeout=850)
    assert proc.returncode == 0, err[-3000:]
    assert _namespaces(f"kvn-{proc.pid}-") == []  # the fabric went with the run
    doc = json.loads(out.strip().splitlines()[-1])
    rows = {(x["case"], x["size"], x["baseline"]): x for x in doc["results"]}
    for op in ("get_tcp", "get_batch_tcp", "put_tcp", "get_tcp-engine", "put_tcp-engine"):
        for size in (64 << 10, 1 << 20):
            x = rows[(op, size, "raw_tcp")]
            assert x["value"] > 0 and x["baseline_value"] > 0 and x["ratio"] is not None
            assert x["extra"]["link_share"] == round(x["value"] / 1.25, 3)
    stream = rows[("stream_raw_tcp", 256 << 20, "link_rate")]
    # tbf holds a stream to the rate (give or take its burst)
    assert stream["baseline_value"] == 1.25 and 0 < stream["ratio"] <= 1.02
    setup = doc["setup"]
    assert setup["rate"] == "10gbit" and setup["rtt_target_ms"] == 1.0
    assert setup["rtt_ms_before"]["min"] >= 2 * setup["delay_ms_each_way"]  # the delay line was on the path
