"""`kvpool bench serve` against a real local cluster: `kvpool up` serving the OpenAI API with one
prefill and one decode worker, loaded with a small multi-round chat workload."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.model]

KVPOOL = str(Path(sys.executable).with_name("kvpool"))
READY_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.exists() else ""


@pytest.fixture
def openai_cluster(tmp_path):
    """`kvpool up --port P --prefill 1 --decode 1` until GET /v1/models answers 200; its base URL."""
    port = _free_port()
    log = tmp_path / "up.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
    with log.open("w") as out:
        proc = subprocess.Popen([KVPOOL, "up", "--port", str(port), "--prefill", "1", "--decode", "1",
                                 "--workdir", str(tmp_path / "cluster")],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + READY_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"kvpool up exited with {proc.returncode}:\n{_log_tail(log)}")
            try:
                if httpx.get(f"{base_url}/models", timeout=5).json()["data"]:  # a worker has joined
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"GET /v1/models did not answer 200 within {READY_S} s:\n{_log_tail(log)}")
            time.sleep(1)
        yield base_url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: only what this test started
                proc.wait(timeout=10)


def test_bench_serve_chat_against_the_cluster(openai_cluster):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
    r = subprocess.run([KVPOOL, "bench", "serve", "--base-url", openai_cluster, "--workload", "chat",
                        "--num-requests", "6", "--rate", "inf", "--output-len", "16", "--system-len", "200",
                        "--system-prompts", "1",
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
    if run.get("mean_cached_tokens") is not None:  # later rounds repeat earlier ones: some prefix is cached
        assert run["mean_cached_tokens"] >= 0
