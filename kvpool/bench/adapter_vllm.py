"""The vLLM cases of `kvpool bench adapter --engine vllm`: TTFT in a fresh real vLLM engine.

Two engine processes (`engine_adapters.vllm_run`) against the bench's pool, one after the other:
a `kv_producer` stores the first 90% of each "cached" prompt (rounded down to whole chunks by the
connector), then a fresh `kv_consumer` (its local prefix cache off, so every cached token is
fetched from the pool) times, alternately after one warm-up pair, a cold prompt and a cached one.
TTFT is one `generate` call with `max_tokens=1`, from arrival to the first token.
"""

from __future__ import annotations

from typing import Any, Callable

BLOCK_SIZE = 32  # vLLM's CPU attention backend takes multiples of 32


def vllm_ttft(address: str, model_path: str, fingerprint: str, model_id: str, fresh_prompt: Callable[[], list[int]],
              tokens: int, reps: int, chunk_tokens: int, dtype: str) -> dict[str, Any]:
    """{"cold": [ms], "cached_90": [ms], "cached_tokens": n, "startup_s": s} of a fresh vLLM engine."""
    from engine_adapters.vllm_run import run_engine

    extra = {"kvpool_address": address, "chunk_tokens": chunk_tokens, "model_id": model_id,
             "weights_fingerprint": fingerprint}
    pairs = [(fresh_prompt(), fresh_prompt()) for _ in range(reps + 1)]  # (cold, cached); pair 0 warms up
    base = {"model": model_path, "dtype": dtype, "block_size": BLOCK_SIZE, "max_model_len": tokens + 64}
    run_engine({**base, "connector": {**extra, "kv_role": "kv_producer"},
                "phases": [{"prompts": [c[: int(tokens * 0.9)] for _, c in pairs], "max_tokens": 1}]})
    order = [p for pair in pairs for p in pair]
    result = run_engine({**base, "connector": {**extra, "kv_role": "kv_consumer"},
                         "phases": [{"prompts": order, "max_tokens": 1, "timed": True}]})
    phase = result["phases"][0]
    ms, cached = phase["ms"], phase["cached_tokens"]
    return {"cold": ms[2::2], "cached_90": ms[3::2], "cached_tokens": cached[3], "cold_cached_tokens": cached[2],
            "startup_s": result["startup_s"], "stats": result["stats"]}
