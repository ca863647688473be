"""The decode side of the reference worker, term by term, for the simulator's `local` profile
(`kvpool sim calibrate` measures the same over HTTP; this measures the parts it cannot separate):

- one sequence's decode step (a batch-1 `ModelRunner.extend` plus `sampling.pick`) at context
  L tokens: the worker's decode step is the sum of these over its running sequences
  (`scheduler.py`), each appending to a `DynamicCache` (a copy of the sequence's whole KV per
  layer per step);
- a handed-off sequence's KV load (`Worker._load_handle`: the pool read of the handle's chunks
  and tail, verification, `cache_from_chunks`): the loading thread's CPU time, the pool
  server's CPU time, and wall time;
- its first step on the engine thread: `cache_from_chunks` leaves each layer's chunks
  unconcatenated (`kvio.ChunkedLayer`) and the first append concatenates them, so the step that
  admits a handed-off sequence copies its whole prompt's KV once more than a steady step.

CPU times are the measuring thread's (`time.thread_time`: torch runs on it with one thread) and
the pool process's (/proc/PID/stat), so they hold on a loaded machine better than wall time.

    PYTHONPATH=. python benchmarks/sim_decode_costs.py [--lengths 128,256,512,1024,1536] [--repeats 3] [--out FILE]
    # a `local` profile: BASE's prefill and KV movement, this decode side scaled to a quiet step time
    PYTHONPATH=. python benchmarks/sim_decode_costs.py --from RUN.json [--from RUN2.json] --base BASE.json \
        --anchor-step-ms 64.7 --anchor-tokens 570 --profile-out PROFILE.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time


def _proc_cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    slope, intercept = statistics.linear_regression(xs, ys)
    return intercept, slope


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="128,256,512,768,1024,1536")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6, help="steady steps timed per sequence")
    ap.add_argument("--out")
    ap.add_argument("--from", dest="sources", action="append", help="fit rows recorded by earlier runs instead of measuring")
    ap.add_argument("--base", help="profile whose prefill and KV movement the written profile keeps")
    ap.add_argument("--anchor-step-ms", type=float, help="a quiet machine's per-sequence decode step...")
    ap.add_argument("--anchor-tokens", type=float, help="...at this many KV tokens of context")
    ap.add_argument("--profile-out")
    args = ap.parse_args()
    if args.sources:
        rows, metas = [], []
        for path in args.sources:
            with open(path) as f:
                doc = json.load(f)
            rows += doc["rows"]
            metas.append(doc["fit"])
        fit = _fit(rows, metas[0]["bytes_per_token"], [max(m["load_average"][0] for m in metas)],
                   " + ".join(m["when"] for m in metas))
    else:
        rows, fit = _measure(args)
    print(json.dumps(fit, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "fit": fit}, f, indent=1)
    if args.profile_out:
        from kvpool.sim.calibrate import with_decode_costs
        from kvpool.sim.profile import load_profile

        prof = with_decode_costs(load_profile(args.base), fit, args.anchor_step_ms / 1e3, args.anchor_tokens)
        prof.save(args.profile_out)
        print(json.dumps(prof.to_json(), indent=1))


def _fit(rows: list[dict], bytes_per_token: int, load_average: list[float], when: str) -> dict:
    xs = [r["tokens"] for r in rows]
    d_seq, d_kv = _fit_line(xs, [r["steady_cpu_ms"] / 1e3 for r in rows])
    j0, j_kv = _fit_line(xs, [(r["join_step_cpu_ms"] - r["after_join_cpu_ms"]) / 1e3 for r in rows])
    l0, l_kv = _fit_line(xs, [(r["load_cpu_ms"] + r["pool_cpu_ms"]) / 1e3 for r in rows])
    w0, w_kv = _fit_line(xs, [r["load_wall_ms"] / 1e3 for r in rows])
    return {"step_cpu_s": {"per_seq": d_seq, "per_kv_token": d_kv},
            "join_extra_cpu_s": {"fixed": j0, "per_kv_token": j_kv},
            "load_cpu_s_worker_plus_pool": {"fixed": l0, "per_kv_token": l_kv},
            "load_wall_s": {"fixed": w0, "per_kv_token": w_kv},
            "bytes_per_token": bytes_per_token, "samples": len(rows), "load_average": load_average, "when": when}


def _measure(args: argparse.Namespace) -> tuple[list[dict], dict]:
    import torch
    from transformers import DynamicCache

    from engine_adapters.serving import sampling
    from engine_adapters.serving.launcher import LocalCluster
    from engine_adapters.serving.server import build_worker
    from engine_adapters.serving.service import WorkerConfig

    torch.set_num_threads(1)
    cluster = LocalCluster(tempfile.mkdtemp(prefix="kvpool-sim-decode-"), []).start()
    pool_pid = cluster.pool_proc.popen.pid
    rng = random.Random("sim-decode-costs")
    rows = []
    try:
        worker = build_worker(WorkerConfig(role="both", pool=cluster.pool_address, local_cache_bytes=0))
        kv, runner = worker.tenants.default, worker.runner
        runner.extend(DynamicCache(), list(range(1, 65)))  # warm-up

        def step(cache, token: int) -> tuple[float, float, int]:
            w0, c0 = time.perf_counter(), time.thread_time()
            nxt = sampling.pick(runner.extend(cache, [token]), None, 0)
            return time.perf_counter() - w0, time.thread_time() - c0, nxt

        for length in [int(x) for x in args.lengths.split(",")]:
            for rep in range(args.repeats):
                ids = [rng.randrange(1000, 40000) for _ in range(length)]
                cache = DynamicCache()
                logits = runner.extend(cache, ids)
                tok = sampling.pick(logits, None, 0)
                steady = []
                for _ in range(args.steps):
                    wall, cpu, tok = step(cache, tok)
                    steady.append((wall, cpu))
                saved = kv.adapter.save(ids, cache, request_id=f"sim-decode-{length}-{rep}", start_token=0)
                handle = kv.adapter.make_handle(ids, saved)
                p0, w0, c0 = _proc_cpu_s(pool_pid), time.perf_counter(), time.thread_time()
                loaded = worker._load_handle(kv, handle)
                load = (time.perf_counter() - w0, time.thread_time() - c0, _proc_cpu_s(pool_pid) - p0)
                first = step(loaded, tok)
                after = [step(loaded, first[2])[:2] for _ in range(2)]
                kv.adapter.store.release_handle(handle)
                rows.append({"tokens": length, "steady_wall_ms": 1e3 * statistics.median(s[0] for s in steady),
                             "steady_cpu_ms": 1e3 * statistics.median(s[1] for s in steady),
                             "load_wall_ms": 1e3 * load[0], "load_cpu_ms": 1e3 * load[1], "pool_cpu_ms": 1e3 * load[2],
                             "join_step_wall_ms": 1e3 * first[0], "join_step_cpu_ms": 1e3 * first[1],
                             "after_join_cpu_ms": 1e3 * statistics.fmean(a[1] for a in after)})
                print(json.dumps({k: round(v, 2) for k, v in rows[-1].items()}), flush=True)
    finally:
        cluster.stop()
    return rows, _fit(rows, worker.layout.bytes_per_token, list(os.getloadavg()),
                      time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()))


if __name__ == "__main__":
    main()
