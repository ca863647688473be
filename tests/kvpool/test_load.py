"""Bounded load test: 16 concurrent SDK clients (4 processes x 4 threads, half reading through
shm, half over TCP) against a real `kvpool serve` process, mixed put / get / get_into /
match_prefix / exists / remove for a fixed time. Then: zero lost objects (every key a client
put and did not remove reads back), zero corrupted ones (every byte checked on every hit),
removed keys are gone, the admin API's object count matches, and p50/p99 latency per operation
is reported (not asserted: timing belongs to `kvpool bench`).

Every value's bytes are a function of its key, so any client can verify any object.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import random
import threading
import time

import httpx
import numpy as np
import pytest
import xxhash

from etcd_testing import serve_process

PROCESSES = 4
THREADS = 4  # per process: 16 clients in all
SIZES = (512, 4096, 16 << 10, 64 << 10, 200_000)
MAX_LIVE = 150  # per client: older keys are removed, so memory stays bounded for any duration
CHAIN = 8  # keys per match_prefix chain


def value_for(key: str) -> bytes:
    """The one correct value of `key` (its size is the key's last field)."""
    size = int(key.rsplit("/", 1)[1])
    seed = xxhash.xxh64_intdigest(key.encode())
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def _client_loop(address: str, client_id: str, use_shm: bool, duration: float, out: dict) -> None:
    import kvpool

    rng = random.Random(client_id)
    lat: dict[str, list[float]] = {op: [] for op in ("put", "get", "get_into", "match_prefix", "exists", "remove")}
    live: list[str] = []
    removed: list[str] = []
    chains: list[list[str]] = []
    errors = _Errors()
    corrupt: list[str] = []
    buf = bytearray(max(SIZES))
    n = 0

    def timed(op, fn, *args):
        start = time.perf_counter()
        result = fn(*args)
        lat[op].append(time.perf_counter() - start)
        return result

    client = kvpool.connect(address, use_shm=use_shm)
    deadline = time.monotonic() + duration
    try:
        while time.monotonic() < deadline:
            r = rng.random()
            try:
                if r < 0.30 or not live:
                    n += 1
                    key = f"load/{client_id}/{n}/{rng.choice(SIZES)}"
                    timed("put", client.put, key, value_for(key))
                    live.append(key)
                elif r < 0.55:
                    key = rng.choice(live)
                    got = timed("get", client.get, key)
                    if got is None:
                        errors.append(f"lost: get({key}) missed")
                    elif got != value_for(key):
                        corrupt.append(key)
                elif r < 0.75:
                    key = rng.choice(live)
                    size = timed("get_into", client.get_into, key, buf)
                    if bytes(memoryview(buf)[:size]) != value_for(key):
                        corrupt.append(key)
                elif r < 0.85:
                    if not chains or len(chains[-1]) == CHAIN:
                        chains.append([])
                    chain = chains[-1]
                    n += 1
                    key = f"chain/{client_id}/{len(chains)}/{len(chain)}/{n}/1024"
                    client.put(key, value_for(key))
                    chain.append(key)
                    probe = chain + [f"chain/{client_id}/absent/{n}/1024"]
                    got = timed("match_prefix", client.match_prefix, probe)
                    if got != len(chain):
                        errors.append(f"match_prefix({len(chain)} present + 1 absent) = {got}")
                elif r < 0.92:
                    key = rng.choice(live)
                    if not timed("exists", client.exists, key):
                        errors.append(f"lost: exists({key}) is False")
                elif len(live) > MAX_LIVE // 2:
                    key = live.pop(0)
                    if not timed("remove", client.remove, key):
                        errors.append(f"remove({key}) returned False")
                    removed.append(key)
                if len(live) > MAX_LIVE:
                    key = live.pop(0)
                    client.remove(key)
                    removed.append(key)
            except Exception as exc:  # any error is a finding; record it and go on
                errors.append(f"{type(exc).__name__}: {exc}")
        # the client's own final check: everything it still owns reads back exactly
        for key, got in _batched(client.get_batch, live):
            if got is None:
                errors.append(f"lost at end: {key}")
            elif got != value_for(key):
                corrupt.append(key)
    finally:
        client.close()
    out.update(lat=lat, live=live + [k for c in chains for k in c], removed=removed[-200:], errors=errors.first,
               n_errors=errors.count, corrupt=corrupt, ops=sum(len(v) for v in lat.values()))


def _batched(call, keys: list[str], n: int = 128):
    """(key, answer) pairs of a batch call made `n` keys at a time (bounded reply sizes)."""
    for i in range(0, len(keys), n):
        part = keys[i:i + n]
        yield from zip(part, call(part))


class _Errors:
    """Counts every error, keeps the first few (a repeating failure must not eat the memory)."""

    def __init__(self, keep: int = 50):
        self.first: list[str] = []
        self.count = 0
        self._keep = keep

    def append(self, text: str) -> None:
        self.count += 1
        if len(self.first) < self._keep:
            self.first.append(text)


def _worker(address: str, worker: int, duration: float, queue) -> None:
    results = [{} for _ in range(THREADS)]
    threads = [threading.Thread(target=_client_loop,
                                args=(address, f"w{worker}t{t}", (worker * THREADS + t) % 2 == 0, duration, results[t]))
               for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    queue.put(results)


@pytest.fixture
def pool_process(tmp_path):
    """`kvpool serve` in its own process, with its admin API; yields (pool address, admin url)."""
    with serve_process(tmp_path / "serve.log", "768MiB") as served:
        yield served


def _percentiles(values: list[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    arr = np.asarray(values) * 1e3
    return float(np.percentile(arr, 50)), float(np.percentile(arr, 99))


def run_load(address: str, admin_url: str, duration: float, report) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(address, w, duration, queue), daemon=True) for w in range(PROCESSES)]
    for p in procs:
        p.start()
    try:
        results = [r for _ in procs for r in queue.get(timeout=duration + 120)]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert len(results) == PROCESSES * THREADS and all(results)

    import kvpool

    errors = [e for r in results for e in r["errors"]]
    corrupt = [k for r in results for k in r["corrupt"]]
    live = [k for r in results for k in r["live"]]
    removed = [k for r in results for k in r["removed"]]
    # an independent client after the load: nothing lost, nothing corrupted, removed keys gone
    with kvpool.connect(address, use_shm=False) as checker:
        got = list(_batched(checker.get_batch, live))
        lost = [k for k, v in got if v is None]
        corrupt += [k for k, v in got if v is not None and v != value_for(k)]
        resurrected = [k for k, hit in _batched(checker.exists_batch, removed) if hit]
    from kvpool.security.local import local_token

    own = {"Authorization": f"Bearer {local_token('admin')}"}  # the pool runs as this user, unconfigured
    stats = httpx.get(f"{admin_url}/v1/stats", timeout=10, headers=own).json()["stats"]

    lat: dict[str, list[float]] = {}
    for r in results:
        for op, values in r["lat"].items():
            lat.setdefault(op, []).extend(values)
    total_ops = sum(r["ops"] for r in results)
    lines = [f"load: {PROCESSES * THREADS} clients, {duration:.0f} s, {total_ops} ops ({total_ops / duration:.0f} ops/s), "
             f"{len(live)} live objects, {len(lost)} lost, {len(corrupt)} corrupted"]
    summary = {"clients": PROCESSES * THREADS, "duration_s": duration, "ops": total_ops, "lost": len(lost),
               "corrupted": len(corrupt), "errors": sum(r["n_errors"] for r in results), "latency_ms": {}}
    for op, values in sorted(lat.items()):
        p50, p99 = _percentiles(values)
        summary["latency_ms"][op] = {"n": len(values), "p50": round(p50, 3), "p99": round(p99, 3)}
        lines.append(f"  {op:<13} n={len(values):>7}  p50={p50:8.3f} ms  p99={p99:8.3f} ms")
    report("\n".join(lines))
    report("load summary: " + json.dumps(summary))

    assert not errors, errors[:10]
    assert not lost, lost[:10]
    assert not corrupt, corrupt[:10]
    assert not resurrected, resurrected[:10]
    assert stats["objects"] == len(live), (stats["objects"], len(live))
    assert total_ops > 0 and all(lat[op] for op in ("put", "get", "get_into", "match_prefix"))
    return summary


@pytest.fixture
def report(capsys):
    """Print the figures even under output capture: reporting p50/p99 is this test's job."""

    def write(text: str) -> None:
        with capsys.disabled():
            print("\n" + text, flush=True)

    return write


def test_load_short(pool_process, report):
    """~10 s version for the default suite."""
    run_load(*pool_process, duration=10.0, report=report)


@pytest.mark.slow
def test_load_60s(pool_process, report):
    run_load(*pool_process, duration=60.0, report=report)
