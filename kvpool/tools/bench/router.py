"""`kvpool bench router`: what the router costs.

- `route_cold` / `route_warm`: the time to route one 8,192-token chat prompt (chat template,
  tokenize, chunk keys, one `match_prefix` to a real embedded pool holding 100,000 chunks,
  snapshot of 16 workers with their local caches, the cache-aware choice). Cold prompts are new
  text every time; warm ones share a long system prompt and earlier turns with previous requests
  and differ in the last user message (multi-round chat). Baseline: tokenizing the same rendered
  text in one call of the `tokenizers` library (Rust), without the router's caches (what a router
  that tokenizes as the model does has to beat). Also the floor of the fast engine the router
  uses for ASCII text (`fast_engine_whole_text_p50_ms`: tiktoken on the whole text in one call,
  kvpool/router/fast_bpe.py). Goal: under 5 ms p99. Also: CPU per route (`cpu_*`, all threads:
  robust on a loaded machine, unlike the wall-clock percentiles), the baseline's CPU
  (`floor_cpu_mean_ms`), collector pauses during the case (`gc_*`; the process is frozen after
  setup, as the router process is once started), and how `match_prefix` was answered
  (`match_inline_calls` / `match_async_calls`, see kvpool/router/matcher.py).
- `ttft_via_router`: TTFT through the router's OpenAI API (streaming, first content chunk) vs
  calling the same prefill worker directly with the token ids (first token in hand), on a real
  local cluster (pool, router, one prefill and one decode worker), alternating. The difference
  is what the router adds (goal: under 2 ms at the median of the paired differences; pairs run
  back to back in A B / B A order).
"""

from __future__ import annotations

import asyncio
import gc
import random
import statistics
import time

import click

from kvpool.tools.bench.report import Report, progress

WORDS = ("harbour ship pilot morning evening channel buoy north south river bridge market tower garden winter "
         "summer lantern engine signal anchor island coast letter number seven cargo tide keeper").split()


def _sentences(rng: random.Random, n_words: int) -> str:
    out, count = [], 0
    while count < n_words:
        k = rng.randint(8, 16)
        out.append(" ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + ".")
        count += k
    return " ".join(out)


def _tokenizer():
    """The reference model's tokenizer files, as a worker would serve them (CLI face: imports on use)."""
    from reference_worker.model import load_reference_model
    from kvpool.router.tokenizer import RouterTokenizer

    rm = load_reference_model()
    tok = rm.tokenizer
    return RouterTokenizer(tok.backend_tokenizer.to_str(), tok.chat_template, bos_token=tok.bos_token,
                           eos_token=tok.eos_token), rm


async def _route_cases(report: Report, reps: int, chunks_indexed: int) -> None:
    import tempfile

    import kvpool
    from kvpool.tools.launch.local import LocalCluster, PoolSpec
    from kvpool import worker_api as wire
    from kvpool.keys import chunk_keys_hex
    from kvpool.router.fast_bpe import fast_bpe
    from kvpool.router.matcher import PrefixMatcher
    from kvpool.router.service import Router, RouterConfig
    from kvpool.router.workers import Workers, WorkerState

    tok, rm = _tokenizer()
    engine, _ = fast_bpe(rm.tokenizer.backend_tokenizer.to_str())  # its floor: the whole text in one call
    ns = rm.namespace(256)
    rng = random.Random(7)
    # The pool in its own process, as deployed: in this one its threads would take the GIL from
    # the routing being timed.
    pool_proc = LocalCluster(tempfile.mkdtemp(prefix="kvpool-bench-router-pool-"), [],
                             PoolSpec(args=["--dram-capacity", "256MiB"]))
    with pool_proc:
        address = pool_proc.pool_address
        sync = kvpool.connect(address)
        bar, step = progress(chunks_indexed // 1000, f"indexing {chunks_indexed} chunks")
        with bar:
            for start in range(0, chunks_indexed, 1000):  # tiny objects: the index is what counts here
                sync.put_batch([(f"{rng.getrandbits(128):032x}", b"x") for _ in range(1000)])
                step()
        router = Router(RouterConfig(pool=address))
        router.pool = await PrefixMatcher(address).connect()
        router.tokenizer, router.chunk_tokens, router.max_positions = tok, 256, 8192
        router.namespace, router.bytes_per_token = ns.digest(), ns.layout.bytes_per_token
        router.workers = Workers(router.backend)
        system = _sentences(rng, 7000)
        sys_ids = tok.encode_chat_prompt([{"role": "system", "content": system}]).ids
        sys_keys = chunk_keys_hex(ns.digest(), sys_ids, 256)
        sync.put_batch([(k, b"x") for k in sys_keys])  # the shared prefix is in the pool
        for i in range(16):
            role = "prefill" if i < 8 else "decode"
            info = wire.WorkerInfo(role=role, model_id="m", namespace=ns.hex(), chunk_tokens=256, dtype="float32",
                                   pool=address, eos_token_ids=[2])
            state = WorkerState(url=f"http://127.0.0.1:{9000 + i}", name=f"{role}-{i}", info=info)
            state.local_keys = {f"{rng.getrandbits(128):032x}" for _ in range(6000)} | set(sys_keys[: i * 2])
            router.workers.by_url[state.url] = state

        gc.collect()
        gc.freeze()  # as the router process does once started (kvpool/router/server.py)

        def prompt(warm: bool) -> list[dict]:
            user = _sentences(rng, 60)
            if warm:
                return [{"role": "system", "content": system}, {"role": "user", "content": user}]
            return [{"role": "system", "content": _sentences(rng, 7000)}, {"role": "user", "content": user}]

        stages: dict[str, list[float]] = {"tokenize": [], "hash_match_choose": [], "cpu": []}
        gc_pauses: list[float] = []

        def on_gc(phase: str, info: dict, _t=[0.0]) -> None:
            if phase == "start":
                _t[0] = time.perf_counter()
            else:
                gc_pauses.append((time.perf_counter() - _t[0]) * 1e3)

        async def route_once(messages) -> tuple[float, int]:
            cpu = time.process_time()  # all threads: the tokenizer's and the pool client's too
            started = time.perf_counter()
            prompt = tok.encode_chat_prompt(messages)
            tokenized = time.perf_counter()
            decision, _, _ = await router.route(prompt.ids, 16, u32=prompt.u32)
            done = time.perf_counter()
            stages["cpu"].append((time.process_time() - cpu) * 1e3)
            assert decision.decode is not None
            stages["tokenize"].append((tokenized - started) * 1e3)
            stages["hash_match_choose"].append((done - tokenized) * 1e3)
            return (done - started) * 1e3, len(prompt.ids)

        for case, warm in (("route_cold", False), ("route_warm", True)):
            for _ in range(3):
                await route_once(prompt(warm))
            ours, base, lengths = [], [], []
            floor_cpu, fast_floor = [], []
            for v in stages.values():
                v.clear()
            gc_pauses.clear()
            router.pool.inline_calls = router.pool.async_calls = 0
            gc.callbacks.append(on_gc)
            bar, step = progress(reps, case)
            with bar:
                for _ in range(reps):
                    messages = prompt(warm)
                    ms, n = await route_once(messages)
                    ours.append(ms)
                    lengths.append(n)
                    text = tok.render_chat(messages)
                    cpu, started = time.process_time(), time.perf_counter()
                    tok.encode_uncached(text, add_special_tokens=False)
                    base.append((time.perf_counter() - started) * 1e3)
                    floor_cpu.append((time.process_time() - cpu) * 1e3)
                    if engine is not None:
                        started = time.perf_counter()
                        engine.encode(text)
                        fast_floor.append((time.perf_counter() - started) * 1e3)
                    step()
            gc.callbacks.remove(on_gc)
            p99 = statistics.quantiles(ours, n=100)[98]
            split = {f"{name}_{q}_ms": round(f(v), 3) for name, v in stages.items()
                     for q, f in (("p50", statistics.median), ("p99", lambda x: statistics.quantiles(x, n=100)[98]))}
            report.add(case, ours, "ms", baseline="tokenize_whole_text", baseline_values=base,
                       extra={**split, "p99_ms": round(p99, 3), "p50_ms": round(statistics.median(ours), 3),
                              "cpu_mean_ms": round(statistics.fmean(stages["cpu"]), 3),
                              "floor_cpu_mean_ms": round(statistics.fmean(floor_cpu), 3),
                              "fast_engine_whole_text_p50_ms": round(statistics.median(fast_floor), 3)
                              if fast_floor else None,
                              "gc_pauses": len(gc_pauses), "gc_pause_max_ms": round(max(gc_pauses, default=0.0), 3),
                              "match_inline_calls": router.pool.inline_calls,
                              "match_async_calls": router.pool.async_calls,
                              "prompt_tokens": int(statistics.median(lengths)), "chunks_indexed": chunks_indexed,
                              "workers": 16, "goal_p99_ms": 5.0, "goal_met": p99 < 5.0})
        await router.pool.close()
        sync.close()


class TtftProbe:
    """A local cluster (router, one prefill and one decode worker) and the two ways to get a first
    token from it, each returning its TTFT in ms: `via_router()` (a streaming chat request through
    the OpenAI API, first content chunk) and `direct()` (the prefill worker called with the token
    ids, first token in hand). Also used by kvpool/tools/scripts/router_hop_breakdown.py."""

    MESSAGES = [{"role": "user", "content": "In one word, what colour is the sea?"}]

    def __enter__(self) -> "TtftProbe":
        import tempfile

        import httpx

        from reference_worker.client import WorkerClient
        from kvpool.tools.launch.local import LocalCluster, RouterSpec, WorkerSpec

        self.cluster = LocalCluster(tempfile.mkdtemp(prefix="kvpool-bench-router-"),
                                    [WorkerSpec("prefill", "prefill"), WorkerSpec("decode", "decode")],
                                    router=RouterSpec(args=["--local-prefill-tokens", "0"]))
        self.cluster.__enter__()
        try:
            self.body = {"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "messages": self.MESSAGES,
                         "max_tokens": 2, "temperature": 0, "stream": True}
            self.prefill = WorkerClient(self.cluster.url("prefill"))
            self.decode = WorkerClient(self.cluster.url("decode"))
            self.ids = self.prefill.tokenize(messages=self.MESSAGES)
            self.http = httpx.Client(timeout=60)
        except BaseException:
            self.cluster.__exit__(None, None, None)
            raise
        return self

    def via_router(self) -> float:
        started = time.perf_counter()
        first = None
        with self.http.stream("POST", f"{self.cluster.router_url}/v1/chat/completions", json=self.body) as resp:
            for line in resp.iter_lines():
                if first is None and line.startswith("data: {") and '"content":"' in line \
                        and '"content":""' not in line:
                    first = time.perf_counter() - started
        if first is None:
            raise RuntimeError("the router's stream ended without a content chunk (its log: "
                               f"{self.cluster.workdir}/router.log)")
        return first * 1e3

    def direct(self) -> float:
        started = time.perf_counter()
        head = self.prefill.prefill(self.ids)
        ttft = time.perf_counter() - started
        for _ in self.decode.decode(head.handle, head.first_token, 2):
            pass
        return ttft * 1e3

    def worker_prefill_s(self) -> float:
        """The prefill worker's own time in prefills so far (`kvpool_worker_prefill_seconds_sum`:
        arrival at its handler to the answer, the push of the KV included)."""
        for line in self.http.get(self.cluster.url("prefill") + "/metrics").text.splitlines():
            if line.startswith("kvpool_worker_prefill_seconds_sum"):
                return float(line.split()[-1])
        raise RuntimeError("the prefill worker's /metrics has no kvpool_worker_prefill_seconds_sum")

    def __exit__(self, *exc: object) -> None:
        self.http.close()
        self.prefill.close()
        self.decode.close()
        self.cluster.__exit__(*exc)


def _overhead_case(report: Report, reps: int) -> None:
    with TtftProbe() as probe:
        def outside_worker(fn):  # (TTFT, TTFT less the prefill worker's own time for that request), ms
            before = probe.worker_prefill_s()
            ttft = fn()
            return ttft, ttft - (probe.worker_prefill_s() - before) * 1e3

        for _ in range(3):
            probe.via_router(), probe.direct()
        ours, base = [], []
        bar, step = progress(reps, "ttft via router vs direct")
        with bar:
            for i in range(reps):  # pairs in A B / B A order: a drift of the machine cancels out
                if i % 2:
                    base.append(outside_worker(probe.direct))
                    ours.append(outside_worker(probe.via_router))
                else:
                    ours.append(outside_worker(probe.via_router))
                    base.append(outside_worker(probe.direct))
                step()
        # Each request's TTFT less the worker's own time in its prefill: what is left is the path
        # to and from the worker (and, via the router, the router). Paired back to back, the
        # difference of those is what the router adds, without the ~10 ms jitter of a ~180 ms
        # CPU prefill that the raw TTFT difference carries (its median is reported too).
        diffs = [a[1] - b[1] for a, b in zip(ours, base)]
        raw = [a[0] - b[0] for a, b in zip(ours, base)]
        added = statistics.median(diffs)
        rng = random.Random(0)  # a bootstrap of each median: how sure the run is of it

        def ci(xs):
            boot = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(1000))
            return [round(boot[25], 3), round(boot[974], 3)]

        report.add("ttft_via_router", [a[0] for a in ours], "ms", baseline="workers_called_directly",
                   baseline_values=[b[0] for b in base],
                   extra={"added_p50_ms": round(added, 3), "added_p50_ci95_ms": ci(diffs),
                          "outside_worker_via_router_p50_ms": round(statistics.median(a[1] for a in ours), 3),
                          "outside_worker_direct_p50_ms": round(statistics.median(b[1] for b in base), 3),
                          "added_raw_ttft_p50_ms": round(statistics.median(raw), 3), "added_raw_ttft_ci95_ms": ci(raw),
                          "goal_added_p50_ms": 2.0, "goal_met": added < 2.0, "prompt_tokens": len(probe.ids)})


@click.command()
@click.option("--reps", type=int, default=200, show_default=True, help="Routes per case.")
@click.option("--chunks", "chunks_indexed", type=int, default=100_000, show_default=True,
              help="Chunks indexed in the pool while routing.")
@click.option("--ttft-reps", type=int, default=100, show_default=True,
              help="Requests each way for the TTFT overhead (0 skips the cluster case).")
@click.option("--json", "as_json", is_flag=True, help="End with one JSON line.")
def router(reps: int, chunks_indexed: int, ttft_reps: int, as_json: bool) -> None:
    """Time to route an 8k-token chat prompt, and what the router adds to TTFT."""
    report = Report("router")
    asyncio.run(_route_cases(report, reps, chunks_indexed))
    if ttft_reps > 0:
        _overhead_case(report, ttft_reps)
    report.emit(as_json)
