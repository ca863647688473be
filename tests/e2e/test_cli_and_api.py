"""The worker HTTP API's contract (typed errors, load report, events) and the user-facing
commands `kvpool generate` and `kvpool up --demo`, all against real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from e2e_support import reference
from kvpool.handle import KVHandle
from kvpool.errors import InvalidArgument, KeyNotFound, LayoutMismatch
from kvpool.tools.launch.processes import clean_env

pytestmark = [pytest.mark.model, pytest.mark.timeout(600)]

KVPOOL = [sys.executable, "-c", "from kvpool.cli import main; main()"]


def test_bad_requests_get_typed_errors_not_tracebacks(cluster, prefill, decode):
    url = cluster.url("prefill")
    for body in (b"{", b'{"token_ids": []}', b'{"token_ids": [1], "v": 7}', b'{"token_ids": [-1]}'):
        resp = httpx.post(f"{url}/v1/prefill", content=body, timeout=60)
        assert resp.status_code == 400, body
        assert resp.json()["code"] == "invalid_argument" and "Traceback" not in resp.text
    with pytest.raises(InvalidArgument):  # a decode worker does not prefill
        decode.prefill([1, 2, 3])
    ns = prefill.info().namespace
    gone = KVHandle(namespace=ns, request_id="nope", num_tokens=3, chunk_tokens=256, chunk_keys=[],
                    tail_key="tail/nope", token_ids=[1, 2, 3])  # a decode worker refuses a handle without them
    with pytest.raises(KeyNotFound):
        list(decode.decode(gone, 5, 4))
    other = KVHandle(namespace="0" * 32, request_id="x", num_tokens=3, chunk_tokens=256, chunk_keys=[],
                     tail_key="tail/x")
    with pytest.raises(LayoutMismatch):
        list(decode.decode(other, 5, 4))


def test_load_report_events_and_metrics(prefill, decode, rm):
    ids = rm.encode("A short prompt about the load report")
    head = prefill.prefill(ids)
    report = prefill.load()
    assert report.role == "prefill" and report.queue_length == 0 and report.cache_capacity_tokens > 0
    list(decode.decode(head.handle, head.first_token, 3))
    text = decode.metrics()
    assert "kvpool_worker_generated_tokens_total" in text and "kvpool_worker_active_sequences" in text
    since = prefill.events(0)
    assert all(e.kind in ("stored", "removed") and e.tier in ("local", "pool") for e in since.events)
    assert prefill.events(since.next).events == []


def test_kvpool_generate_cli_streams_and_ends_with_json(cluster, rm):
    out = subprocess.run([*KVPOOL, "generate", "--prefill", cluster.url("prefill"), "--decode", cluster.url("decode"),
                          "--message", "What is the capital of Spain?", "--max-tokens", "6", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(doc) >= {"text", "token_ids", "ttft_ms", "cached_tokens", "computed_tokens"}
    ids = rm.encode_chat([{"role": "user", "content": "What is the capital of Spain?"}])
    assert doc["token_ids"] == reference(rm, ids, 6)
    assert doc["text"] == rm.decode(doc["token_ids"]) and doc["text"] in out.stdout
    assert doc["computed_tokens"] + doc["cached_tokens"] == len(ids)


def test_kvpool_generate_cli_rejects_bad_usage(cluster):
    out = subprocess.run([*KVPOOL, "generate", "--prefill", cluster.url("prefill"), "--decode", cluster.url("decode")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "exactly one of --prompt or --message" in out.stderr


@pytest.mark.slow
def test_kvpool_up_demo_runs_and_stops_cleanly(tmp_path):
    out = subprocess.run([*KVPOOL, "up", "--demo", "--max-tokens", "8", "--workdir", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("TTFT") == 2
    second = out.stdout.split("[2]")[1]
    assert " 0 from the cache" not in second  # the shared prefix was reused


@pytest.mark.slow
def test_kvpool_up_stops_its_processes_on_sigint(tmp_path):
    proc = subprocess.Popen([*KVPOOL, "up", "--workdir", str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C stops" in line or time.monotonic() > deadline:
                break
        ready = {p.stem: json.loads(p.read_text())["pid"] for p in tmp_path.glob("*.ready")}
        assert set(ready) == {"router", "prefill-0", "decode-1"}, "".join(lines)  # (the pool reports on its stdout)
        pids = list(ready.values())
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if proc.poll() is None:
            proc.kill()


TREE = """
[node]
dram_capacity = "40MiB"

[router]
policy = "round_robin"

[worker]
max_batch = 3

[[workers]]
role = "both"
local_cache = "8MiB"
"""


def test_kvpool_up_and_kvpool_node_read_the_same_file(tmp_path):
    """One configuration tree: `kvpool up` hands its file to the pool, the router and the worker
    it starts (each reads its own sections), and `kvpool node` reads the same file alike."""
    import kvpool

    cfg = tmp_path / "cluster.toml"
    cfg.write_text(TREE)
    env = clean_env()
    proc = subprocess.Popen([*KVPOOL, "up", "--config", str(cfg), "--port", "0", "--workdir", str(tmp_path / "up"),
                             "--set", "worker.threads=1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines, pool, router = [], None, None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("pool "):
                pool = line.split()[-1]
            if "OpenAI API:" in line:
                router = line.split()[2].removesuffix("/v1")
            if "Ctrl-C stops" in line:
                break
        assert pool and router, "".join(lines)
        with kvpool.connect(pool) as client:
            (node,) = client.admin("nodes")
        assert node["capacity_bytes"] == 40 << 20  # the pool read [node]
        doc = httpx.get(f"{router}/admin/workers", timeout=10).json()
        assert doc["policy"] == "round_robin"  # the router read [router]
        (worker,) = doc["workers"]
        load = httpx.get(f"{worker['url']}/load", timeout=10).json()
        assert load["role"] == "both" and load["max_batch"] == 3  # the worker read [worker] and [[workers]]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    master, address = _service(["master", "--port", "0", "--admin-port", "0", "--heartbeat-s", "0.2"], env)
    try:
        node, _ = _service(["node", "--config", str(cfg), "--port", "0", "--master", address, "--admin-port", "0",
                            "--heartbeat-s", "0.2"], env)
        try:
            with kvpool.connect(address) as client:
                deadline = time.monotonic() + 10
                while not client.admin("nodes") and time.monotonic() < deadline:
                    time.sleep(0.1)
                (entry,) = client.admin("nodes")
            assert entry["capacity_bytes"] == 40 << 20  # the node read the same [node]
        finally:
            node.terminate()
            node.wait(30)
    finally:
        master.terminate()
        master.wait(30)


def _service(args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """`kvpool ARGS` started, and the address of its ready line ("kvpool ... at HOST:PORT")."""
    proc = subprocess.Popen([*KVPOOL, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("kvpool "):
            return proc, line.split()[-1]
    proc.kill()
    raise AssertionError(f"kvpool {' '.join(args)} did not start:\n{''.join(lines)}")
