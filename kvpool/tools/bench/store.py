"""`kvpool bench store`: one node's tiers against the machine's own ceilings, in one run.

- DRAM `get_into` / `put` of 64 KiB, 1 MiB, 8 MiB objects vs single-thread memcpy of the same
  sizes over the same working set (ours and memcpy alternate, see report.alternate).
- SSD (lmdb) get / put vs sequential file read / write of the same bytes in the same directory
  (neither side fsyncs: the lmdb tier does not, see kvpool/tiers/ssd.py).
- Eviction policy: block hit ratio of S3-FIFO and ARC vs LRU replaying a request trace (512-token
  prefix-hash blocks), counting only each request's cached *prefix* as a prefix cache would, with
  each request's blocks also read once by its decode worker a few requests later (the P/D
  hand-off); `handoffs_lost` is the share of those reads that found a block evicted.
Goals (issue "Foundations"): DRAM get_into >= 0.7x memcpy from 1 MiB up; SSD get >= 0.5x read.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import NamedTuple

import click
import numpy as np

from kvpool.tools.bench.report import Report, alternate, gbps, progress, timed

SIZES = (64 << 10, 1 << 20, 8 << 20)
TRACE = "/work/shared/data/traces/conversation_trace.jsonl"


def _working_set(size: int, total: int) -> tuple[int, memoryview]:
    """n objects of `size` filling about `total` bytes of random data (at least 4 objects)."""
    n = max(4, total // size)
    data = np.random.default_rng(size).integers(0, 256, n * size, dtype=np.uint8)
    return n, memoryview(data).cast("B")


def _bench_dram(report: Report, size: int, total: int, rounds: int, reps: int, tick) -> None:
    from kvpool.tiers import TieredStore

    n, src = _working_set(size, total)
    store = TieredStore(n * size + (16 << 20), policy="lru")
    try:
        keys = [f"obj{i}" for i in range(n)]
        dst = memoryview(bytearray(size))  # both sides copy into the same memoryview
        memcpy_dst = bytearray(n * size)  # the baseline's "arena": same layout as ours
        mv_dst = memoryview(memcpy_dst)

        def put_ours() -> float:
            for k in keys:
                store.remove(k)
            seconds = timed(lambda: [store.put(k, src[i * size : (i + 1) * size]) for i, k in enumerate(keys)])
            return gbps(n * size, seconds)

        def put_memcpy() -> float:
            def run():
                for i in range(n):
                    mv_dst[i * size : (i + 1) * size] = src[i * size : (i + 1) * size]
            return gbps(n * size, timed(run))

        def get_ours() -> float:
            def run():
                for _ in range(rounds):
                    for k in keys:
                        store.get_into(k, dst)
            return gbps(rounds * n * size, timed(run))

        def get_memcpy() -> float:
            def run():
                for _ in range(rounds):
                    for i in range(n):
                        dst[:] = mv_dst[i * size : (i + 1) * size]
            return gbps(rounds * n * size, timed(run))

        ours, base = alternate(put_ours, put_memcpy, reps=reps, on_rep=tick)
        report.add("dram_put", ours, "GB/s", size=size, baseline="memcpy", baseline_values=base)
        assert store.get(keys[-1]) == bytes(src[(n - 1) * size :]), "bench read back wrong bytes"
        ours, base = alternate(get_ours, get_memcpy, reps=reps, on_rep=tick)
        report.add("dram_get_into", ours, "GB/s", size=size, baseline="memcpy", baseline_values=base)
    finally:
        store.close()


def _bench_ssd(report: Report, size: int, total: int, reps: int, workdir: str, tick) -> None:
    from kvpool.tiers import SsdTier

    n, src = _working_set(size, total)
    tier = SsdTier(os.path.join(workdir, f"lmdb-{size}"), n * size * 2 + (64 << 20))
    path = os.path.join(workdir, f"seq-{size}.bin")
    keys = [f"obj{i}" for i in range(n)]
    dst = memoryview(bytearray(size))
    try:
        def put_ours() -> float:
            for k in keys:
                tier.remove(k)
            return gbps(n * size, timed(lambda: [tier.put(k, src[i * size : (i + 1) * size]) for i, k in enumerate(keys)]))

        with open(path, "wb") as f:  # overwrite in place below, as lmdb reuses its freed pages
            f.truncate(n * size)

        def write_file() -> float:
            def run():
                with open(path, "r+b", buffering=0) as f:
                    for i in range(n):
                        f.write(src[i * size : (i + 1) * size])
            return gbps(n * size, timed(run))

        def get_ours() -> float:
            return gbps(n * size, timed(lambda: [tier.get_into(k, dst) for k in keys]))

        def read_file() -> float:
            def run():
                with open(path, "rb", buffering=0) as f:
                    for _ in range(n):
                        f.readinto(dst)
            return gbps(n * size, timed(run))

        ours, base = alternate(put_ours, write_file, reps=reps, on_rep=tick)
        report.add("ssd_put", ours, "GB/s", size=size, baseline="file_write", baseline_values=base)
        assert tier.get(keys[-1]) == bytes(src[(n - 1) * size :]), "bench read back wrong bytes"
        ours, base = alternate(get_ours, read_file, reps=reps, on_rep=tick)
        report.add("ssd_get", ours, "GB/s", size=size, baseline="file_read", baseline_values=base)
    finally:
        tier.close()


HANDOFF_LAG = 4  # requests between a prefill's write of its blocks and its decode worker's read


class Replay(NamedTuple):
    hit_ratio: float  # prefix blocks found cached, over all prompt blocks
    handoffs_lost: float  # blocks the decode worker found evicted, over all it read


def replay_trace(requests: list[list[int]], policy_name: str, capacity_blocks: int,
                 handoff_lag: int | None = HANDOFF_LAG) -> Replay:
    """A pool of `capacity_blocks` blocks under a policy, used as in P/D serving: each request's
    prefill reads its cached prefix and writes the blocks it computed; with `handoff_lag`, the
    decode worker then reads the request's blocks, `handoff_lag` requests later (the KV hand-off,
    read once and possibly evicted before it), counted apart from the prefix hits."""
    from kvpool.tiers import make_policy

    policy = make_policy(policy_name, capacity_blocks)
    cached: set[int] = set()
    hits = total = lost = handed = 0
    evictable = lambda k: True  # noqa: E731 - nothing is pinned in a replay
    waiting: list[list[int]] = []
    for blocks in requests:
        total += len(blocks)
        n = 0
        while n < len(blocks) and blocks[n] in cached:
            n += 1
        hits += n
        for b in blocks[:n]:
            policy.access(b)
        for b in blocks[n:]:
            if b in cached:
                policy.access(b)
                continue
            while len(cached) >= capacity_blocks:
                cached.discard(policy.evict(evictable))
            policy.insert(b, 1)
            cached.add(b)
        if handoff_lag is not None:
            waiting.append(blocks)
            if len(waiting) > handoff_lag:
                for b in waiting.pop(0):
                    handed += 1
                    if b in cached:
                        policy.access(b)
                    else:
                        lost += 1
    return Replay(hits / total if total else 0.0, lost / handed if handed else 0.0)


def _bench_policy(report: Report, trace: str, limit: int | None, tick) -> None:
    requests: list[list[int]] = []
    with open(trace) as f:
        for line in f:
            requests.append(json.loads(line)["hash_ids"])
            if limit and len(requests) >= limit:
                break
    unique = len({b for r in requests for b in r})
    for fraction in (0.02, 0.05, 0.1):
        cap = max(8, int(unique * fraction))
        lru = replay_trace(requests, "lru", cap)
        for name in ("s3fifo", "arc"):
            ours = replay_trace(requests, name, cap)
            report.add(f"policy_hit_ratio_{name}", [ours.hit_ratio], "hit_ratio", size=cap, baseline="lru",
                       baseline_values=[lru.hit_ratio],
                       extra={"cache_blocks": cap, "unique_blocks": unique, "requests": len(requests),
                              "fraction_of_unique": fraction, "handoffs_lost": round(ours.handoffs_lost, 5),
                              "lru_handoffs_lost": round(lru.handoffs_lost, 5), "handoff_lag": HANDOFF_LAG})
        tick()


@click.command("store")
@click.option("--json", "as_json", is_flag=True, help="End with one JSON line (see BENCH.md).")
@click.option("--reps", default=9, show_default=True, help="Alternating repetitions per figure.")
@click.option("--working-set", default=64, show_default=True, help="MiB of objects per size (DRAM and SSD).")
@click.option("--rounds", default=8, show_default=True, help="Reads of the whole working set per DRAM get figure.")
@click.option("--trace", default=TRACE, show_default=True, help="JSONL request trace with 'hash_ids' per line.")
@click.option("--trace-limit", type=int, default=None, help="Replay only the first N requests.")
@click.option("--dir", "workdir", default=None, help="Directory for the SSD tier and files (default: a temp dir).")
def store(as_json: bool, reps: int, working_set: int, rounds: int, trace: str, trace_limit: int | None,
          workdir: str | None) -> None:
    """DRAM and SSD tier throughput vs memcpy / file ceilings, and S3-FIFO / ARC vs LRU on a trace."""
    report = Report("store")
    total = working_set << 20
    has_trace = Path(trace).exists()
    steps = len(SIZES) * 4 * reps + (3 if has_trace else 0)
    bar, tick = progress(steps, "bench store")
    with bar, tempfile.TemporaryDirectory(dir=workdir, prefix="kvpool-bench-") as tmp:
        for size in SIZES:
            _bench_dram(report, size, total, rounds, reps, tick)
        for size in SIZES:
            _bench_ssd(report, size, total, reps, tmp, tick)
        if has_trace:
            _bench_policy(report, trace, trace_limit, tick)
        else:
            report.notes.append(f"trace {trace} not found: policy comparison skipped")
    report.notes.append("SSD figures go through the OS page cache on both sides (lmdb and the plain file)")
    report.emit(as_json)
