"""`kvpool worker` as a real process: registration with a router (a recording HTTP server here),
draining on SIGTERM with a stream in flight, and a quick exit when idle."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from serving_support import RecordingRouter

from kvpool import worker_api as m
from kvpool.tools.launch.processes import free_port

pytestmark = pytest.mark.model

LONG_STREAM = 200  # tokens; ~20 ms each here, so the stream is open for seconds after SIGTERM


def registrations(url: str, n: int):
    """At least `n` register POSTs for `url` (the router answered 503 to the first ones)."""
    return lambda r: sum(p == "/admin/workers" and b == {"url": url} for _, p, b in r.posts) >= n


def test_registers_drains_with_a_stream_in_flight_and_exits_zero(spawn_worker):
    port = free_port()  # nothing listens here yet: the worker must keep retrying
    worker = spawn_worker("both", "--router", f"http://127.0.0.1:{port}", "--set", "worker.drain_timeout_s=120")
    time.sleep(1.5)
    router = RecordingRouter(port=port, fail_first=2)  # comes up, then answers 503 twice
    try:
        assert router.wait_for(registrations(worker.url, 3), timeout=15), (router.posts, worker.log_tail())
        times = [t for t, p, _ in router.posts if p == "/admin/workers"]
        assert len(times) == 3 and times[-1] - times[0] < 4  # 5xx: retried every ~1 s, not every 5 s
        assert router.wait_for(lambda r: len(r.posts) >= 4, timeout=8)  # registered: repeated (~5 s)

        events: list[m.TokenEvent] = []
        first_line = threading.Event()

        def read_stream() -> None:
            body = {"token_ids": list(range(100, 130)), "max_tokens": LONG_STREAM, "stop_token_ids": []}
            with httpx.stream("POST", f"{worker.url}/v1/generate", json=body, timeout=120) as resp:
                for line in resp.iter_lines():
                    if line.strip():
                        events.append(m.decode(line, m.TokenEvent))
                        first_line.set()

        reader = threading.Thread(target=read_stream)
        reader.start()
        assert first_line.wait(60)
        worker.popen.send_signal(signal.SIGTERM)

        assert router.wait_for(lambda r: "/admin/workers/drain" in r.paths(), timeout=10), worker.log_tail()
        _, _, drain_body = next(x for x in router.posts if x[1] == "/admin/workers/drain")
        assert drain_body == {"url": worker.url}
        health = httpx.get(f"{worker.url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        refused = httpx.post(f"{worker.url}/v1/generate", json={"token_ids": [1, 2, 3]}, timeout=10)
        assert refused.status_code == 503 and refused.json()["code"] == "unavailable"
        assert "draining" in refused.json()["message"]
        load = httpx.get(f"{worker.url}/load", timeout=10).json()
        assert load["draining"] and load["open_streams"] == 1
        assert not events or not events[-1].done, "the stream ended before the drain could be observed"

        reader.join(120)
        tokens = [e for e in events if not e.done]
        assert len(tokens) == LONG_STREAM and events[-1].done and events[-1].finish_reason == "length"
        assert worker.popen.wait(30) == 0, worker.log_tail()
        drained_at = next(t for t, p, _ in router.posts if p == "/admin/workers/drain")
        assert all(t < drained_at for t, p, _ in router.posts if p == "/admin/workers")  # never re-added
    finally:
        router.close()


def test_idle_worker_exits_zero_within_seconds_and_decode_role_generates(spawn_worker):
    import os

    core = max(os.sched_getaffinity(0))
    worker = spawn_worker("decode", "--cpus", str(core))  # pinned: one core, one torch thread
    status = open(f"/proc/{worker.popen.pid}/status").read()
    assert f"Cpus_allowed_list:\t{core}\n" in status, status
    resp = httpx.post(f"{worker.url}/v1/generate", json={"token_ids": list(range(200, 220)), "max_tokens": 3},
                      timeout=60)
    assert resp.status_code == 200
    assert json.loads(resp.text.splitlines()[-1])["done"]
    assert httpx.get(f"{worker.url}/load", timeout=10).json()["decode_token_ms"] > 0
    started = time.monotonic()
    worker.popen.send_signal(signal.SIGTERM)
    assert worker.popen.wait(15) == 0, worker.log_tail()
    assert time.monotonic() - started < 5
