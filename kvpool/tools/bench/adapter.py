"""`kvpool bench adapter`: time to first token of a long prompt, cold vs partly cached.

A reference prefill worker (in this process, with its local prefix cache off so every cached
token is fetched from the pool) and a real embedded pool. Each repetition uses fresh prompts
and measures, in rotating order:

- `cold`: nothing cached, the whole prompt computed (the baseline of the cached cases);
- `cached_50` / `cached_90`: the first 50% / 90% of the prompt was stored by an earlier
  prefill (rounded down to whole chunks), so only the rest is computed and the prefix fetched;
- `model_forward`: the bare model forward of the whole prompt, no pool, no worker (the
  baseline of `cold`: what the worker path adds on top of compute);
- `floor_90`: the bare forward of the uncached rest of a 90%-cached prompt (the same whole
  chunks as `cached_90`) with the cached part already in memory as the engine's own cache (no
  pool, no worker, no HTTP; the cache is computed untimed). It is the floor of `cached_90`:
  `ttft_cached_90_vs_floor` is `cached_90` with this as its baseline (goal: ratio >= 1/1.1).

- `tcp_cached_90_none` / `tcp_cached_90_<codec>` (the codec column, `--codec`, default int8):
  `cached_90` in two more workers whose pool client reads over loopback TCP as a client on
  another host does (no shared-memory path), one storing chunks uncompressed, one with the
  codec; `ttft_tcp_cached_90_<codec>` has the uncompressed one as its baseline.

TTFT is the prefill call from arrival to first token with the KV pushed to the pool.

`--engine vllm` adds, in the same run and against the same pool, `vllm_ttft_cold` and
`vllm_ttft_cached_90`: the same kind of prompts in a fresh real vLLM engine with the kvpool
connector (`adapter_vllm.py`: the engines run in .venv-vllm's Python by default, where vLLM pins
its own torch and transformers; the HF figures come from this environment).
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from dataclasses import replace

import click

from kvpool.tools.bench.report import Report, progress


@click.command()
@click.option("--tokens", type=int, default=2048, show_default=True, help="Prompt length.")
@click.option("--reps", type=int, default=3, show_default=True, help="Measured repetitions (after 1 warm-up).")
@click.option("--chunk-tokens", type=int, default=256, show_default=True)
@click.option("--engine", type=click.Choice(["hf", "vllm"]), default="hf", show_default=True,
              help="vllm: also a fresh real vLLM engine with the kvpool connector (see --vllm-python).")
@click.option("--vllm-dtype", default="float32", show_default=True, help="dtype of the vLLM engine.")
@click.option("--vllm-python", default=None, help="Python of an environment with vLLM and kvpool "
              "(default: .venv-vllm/bin/python, else this one).")
@click.option("--codec", "codec_name", default="int8", show_default=True,
              help="The codec column: 90%-cached TTFT over TCP with this codec vs none ('none': no column).")
@click.option("--json", "as_json", is_flag=True, help="End with one JSON line.")
def adapter(tokens: int, reps: int, chunk_tokens: int, engine: str, vllm_dtype: str, vllm_python: str | None,
            codec_name: str, as_json: bool) -> None:
    """TTFT of a long prompt: cold vs 50% and 90% cached (fetched from the pool)."""
    if engine == "vllm":
        from kvpool.tools.bench.adapter_vllm import vllm_python as find_vllm_python

        vllm_python = find_vllm_python(vllm_python)
    import torch

    import kvpool
    from reference_worker.model_runner import ModelRunner
    from reference_worker.model import load_reference_model
    from kvpool.worker_api import PrefillRequest
    from reference_worker.service import Worker, WorkerConfig
    from kvpool.config import load_settings
    from kvpool.embedded import EmbeddedPool

    rm = load_reference_model()
    kv_bytes = rm.layout(chunk_tokens).bytes_per_token * tokens
    settings = load_settings(port=0, admin_port=0, dram_capacity=max(1 << 30, 6 * kv_bytes))
    rng = random.Random(1234)
    vocab = rm.model.config.vocab_size

    def fresh_prompt() -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(tokens)]

    with EmbeddedPool(settings) as pool_server:
        client = kvpool.connect(pool_server.address)
        worker = Worker(WorkerConfig(role="prefill", pool=pool_server.address, chunk_tokens=chunk_tokens,
                                     local_cache_bytes=0), rm, client).start()
        tcp_client = kvpool.connect(pool_server.address, use_shm=False)  # loopback TCP, as from another host
        tcp_workers = {name: Worker(WorkerConfig(role="prefill", pool=pool_server.address, chunk_tokens=chunk_tokens,
                                                 local_cache_bytes=0, kv_codec=name), rm, tcp_client).start()
                       for name in (("none", codec_name) if codec_name != "none" else ())}
        tcp_fetch: dict[str, list[float]] = {name: [] for name in tcp_workers}
        try:
            def tcp_cached_90(name: str) -> tuple[float, int]:
                ids = fresh_prompt()
                tcp_worker = tcp_workers[name]
                asyncio.run(tcp_worker.prefill(PrefillRequest(token_ids=ids[: int(tokens * 0.9)])))  # not timed
                resp = asyncio.run(tcp_worker.prefill(PrefillRequest(token_ids=ids)))
                tcp_fetch[name].append(resp.fetch_ms)
                return resp.prefill_ms, resp.cached_tokens

            stages: dict[str, list[float]] = {"fetch_ms": [], "compute_ms": [], "push_ms": []}  # of cached_90

            def ttft(ids: list[int], record: bool = False) -> tuple[float, int]:
                resp = asyncio.run(worker.prefill(PrefillRequest(token_ids=ids)))
                if record:
                    for name, values in stages.items():
                        values.append(getattr(resp, name))
                return resp.prefill_ms, resp.cached_tokens

            def cached(fraction: float):
                ids = fresh_prompt()
                ttft(ids[: int(tokens * fraction)])  # store the prefix (not timed)
                return ttft(ids, record=fraction == 0.9)

            def forward_ms() -> tuple[float, int]:
                ids = torch.tensor([fresh_prompt()])
                started = time.perf_counter()
                with torch.inference_mode():
                    rm.model(input_ids=ids, logits_to_keep=1)
                return (time.perf_counter() - started) * 1e3, 0

            runner = ModelRunner(rm.model)
            floor_cached = int(tokens * 0.9) // chunk_tokens * chunk_tokens  # what cached_90 gets from the pool

            def floor_ms() -> tuple[float, int]:
                ids = fresh_prompt()
                kv = runner.new_kv(len(ids))
                runner.step([(kv, ids[:floor_cached])])  # the engine's own cache of the prefix (not timed)
                started = time.perf_counter()
                runner.step([(kv, ids[floor_cached:])])  # the worker's engine makes this very call
                return (time.perf_counter() - started) * 1e3, floor_cached

            cases = {"cold": lambda: ttft(fresh_prompt()), "cached_50": lambda: cached(0.5),
                     "cached_90": lambda: cached(0.9), "floor_90": floor_ms, "model_forward": forward_ms,
                     **{f"tcp_cached_90_{name}": (lambda name=name: tcp_cached_90(name)) for name in tcp_workers}}
            samples: dict[str, list[float]] = {name: [] for name in cases}
            cached_tokens: dict[str, int] = {}
            bar, advance = progress((reps + 1) * len(cases), f"adapter bench ({tokens}-token prompt)")
            names = list(cases)
            with bar:
                for rep in range(reps + 1):  # rep 0 is the warm-up
                    order = names[rep % len(names):] + names[:rep % len(names)]  # rotate: same noise for all
                    for name in order:
                        ms, n_cached = cases[name]()
                        if rep:
                            samples[name].append(ms)
                            cached_tokens[name] = n_cached
                        advance()
            stages = {name: values[1:] for name, values in stages.items()}  # the warm-up's left out
            tcp_fetch = {name: values[1:] for name, values in tcp_fetch.items()}
        finally:
            worker.stop()
            for tcp_worker in tcp_workers.values():
                tcp_worker.stop()
            tcp_client.close()
            client.close()
        vllm = None
        if engine == "vllm":
            from kvpool.tools.bench.adapter_vllm import vllm_ttft

            print(f"vLLM: a producer and a fresh consumer engine, {reps} + 1 pairs", file=sys.stderr)
            vllm = vllm_ttft(pool_server.address, str(rm.path), rm.fingerprint, rm.model_id, fresh_prompt, tokens, reps,
                             chunk_tokens, vllm_dtype, vllm_python)

    report = Report("adapter")
    for name in ("cached_50", "cached_90"):
        report.add(f"ttft_{name}", samples[name], "ms", baseline="ttft_cold", baseline_values=samples["cold"],
                   extra={"prompt_tokens": tokens, "cached_tokens": cached_tokens[name],
                          "computed_tokens": tokens - cached_tokens[name],
                          "ttft_fraction_of_cold": round(_median(samples[name]) / _median(samples["cold"]), 3)})
    floor_extra = {"prompt_tokens": tokens, "cached_tokens": cached_tokens["floor_90"],
                   "computed_tokens": tokens - cached_tokens["floor_90"]}
    report.add("ttft_floor_90", samples["floor_90"], "ms", baseline="ttft_cold", baseline_values=samples["cold"],
               extra={**floor_extra, "ttft_fraction_of_cold": round(_median(samples["floor_90"]) / _median(samples["cold"]), 3)})
    report.add("ttft_cached_90_vs_floor", samples["cached_90"], "ms", baseline="ttft_floor_90",
               baseline_values=samples["floor_90"],
               extra={**floor_extra, "x_floor": round(_median(samples["cached_90"]) / _median(samples["floor_90"]), 3),
                      "fetch_ms": _median(stages["fetch_ms"]), "compute_ms": _median(stages["compute_ms"]),
                      "push_ms": _median(stages["push_ms"])})
    report.add("ttft_cold", samples["cold"], "ms", baseline="model_forward", baseline_values=samples["model_forward"],
               extra={"prompt_tokens": tokens, "cached_tokens": 0, "computed_tokens": tokens})
    if tcp_workers:
        from kvpool.codec import get_codec

        layout = rm.layout(chunk_tokens)
        plain = layout.payload_nbytes(chunk_tokens)
        # a bound for a variable-rate codec (+zstd), exact for a fixed-rate one
        packed = get_codec(codec_name).max_encoded_nbytes(replace(layout, codec=codec_name), chunk_tokens)
        tcp = {name: samples[f"tcp_cached_90_{name}"] for name in tcp_workers}
        report.add(f"ttft_tcp_cached_90_{codec_name}", tcp[codec_name], "ms", baseline="ttft_tcp_cached_90_none",
                   baseline_values=tcp["none"],
                   extra={"prompt_tokens": tokens, "cached_tokens": cached_tokens[f"tcp_cached_90_{codec_name}"],
                          "codec": codec_name, "chunk_bytes_vs_none": round(packed / plain, 3),
                          "fetch_ms": _median(tcp_fetch[codec_name]), "fetch_ms_none": _median(tcp_fetch["none"])})
        report.add("ttft_tcp_cached_90_none", tcp["none"], "ms", baseline="ttft_cold", baseline_values=samples["cold"],
                   extra={"prompt_tokens": tokens, "cached_tokens": cached_tokens["tcp_cached_90_none"]})
        report.notes.append("tcp_*: the 90%-cached prompt read over loopback TCP (a client with no shared-memory "
                            f"path, as on another host), chunks stored uncompressed vs {codec_name}")
    if vllm is not None:
        report.add("vllm_ttft_cached_90", vllm["cached_90"], "ms", baseline="vllm_ttft_cold", baseline_values=vllm["cold"],
                   extra={"prompt_tokens": tokens, "cached_tokens": vllm["cached_tokens"], "dtype": vllm_dtype,
                          "computed_tokens": tokens - vllm["cached_tokens"], "connector": vllm["stats"],
                          "ttft_fraction_of_cold": round(_median(vllm["cached_90"]) / _median(vllm["cold"]), 3)})
        report.add("vllm_ttft_cold", vllm["cold"], "ms", baseline="ttft_cold", baseline_values=samples["cold"],
                   extra={"prompt_tokens": tokens, "cached_tokens": vllm["cold_cached_tokens"], "dtype": vllm_dtype,
                          "engine_startup_s": round(vllm["startup_s"], 1)})
        report.notes.append("vllm_*: a fresh vLLM engine (CPU build, in-process, kv_consumer, local prefix cache off) "
                            "loading what a kv_producer engine stored; vllm_ttft_cold's baseline is the HF worker's cold TTFT")
    report.notes.append("cached tokens are whole chunks fetched from the pool (worker-local cache off), so "
                        f"'90%' is {cached_tokens['cached_90']} of {tokens} tokens; goal: ttft_cached_90 under "
                        "0.2x cold, i.e. ratio above 5")
    report.emit(as_json)


def _median(values: list[float]) -> float:
    import statistics

    return statistics.median(values)
