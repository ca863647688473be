"""`kvpool bench serve` against a real local cluster: the e2e session cluster's router serving the
OpenAI API in front of its real workers (tests/e2e/conftest.py), loaded with a small multi-round
chat workload. (`kvpool up` itself is started by the slow tests in test_cli_and_api.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from kvpool.tools.launch.processes import clean_env

pytestmark = [pytest.mark.model]

KVPOOL = str(Path(sys.executable).with_name("kvpool"))


@pytest.fixture
def openai_cluster(cluster):
    """The base URL of the session cluster's OpenAI API."""
    return f"{cluster.router_url}/v1"


def test_bench_serve_chat_against_the_cluster(openai_cluster):
    env = clean_env()
    r = subprocess.run([KVPOOL, "bench", "serve", "--base-url", openai_cluster, "--workload", "chat",
                        "--num-requests", "6", "--rate", "inf", "--set", "output_len=16", "--set", "system_len=700",
                        "--set", "system_prompts=1", "--set", "max_concurrency=1",
                        "--json"], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert doc["bench"] == "serve" and doc["config"]["workload"] == "chat" and doc["config"]["num_requests"] == 6
    (run,) = doc["runs"]
    assert run["completed"] == 6 and run["failed"] == 0, run["errors"]
    assert run["rate"] == "inf" and run["model"]
    assert 0 < run["ttft_median"] <= run["ttft_p99"] <= run["e2e_p99"]
    assert 0 < run["ttft_mean"] <= run["e2e_mean"]
    assert run["tpot_count"] > 0 and run["tpot_mean"] > 0 and run["itl_count"] > 0
    assert run["total_output_tokens"] >= 6 and run["total_input_tokens"] > 6 * 200
    assert run["request_throughput"] > 0 and run["output_throughput"] > 0
    assert run["total_token_throughput"] > run["output_throughput"]
    cases = {x["case"]: x for x in doc["results"]}
    assert cases["completed"]["value"] == 6 and cases["failed"]["value"] == 0
    assert cases["ttft_mean"]["unit"] == "ms" and cases["ttft_mean"]["value"] == run["ttft_mean"]
    # One at a time, every request after the first finds the shared 700-token system prompt's first
    # 512-token block cached (the pool's chunks, reported in usage.prompt_tokens_details).
    assert run["mean_cached_tokens"] >= 5 * 512 / 6, run["mean_cached_tokens"]
