"""The vLLM cases of `kvpool bench adapter --engine vllm`: TTFT in a fresh real vLLM engine.

Two engine processes (`kvpool.tools.vllm_run`) against the bench's pool, one after the other:
a `kv_producer` stores the first 90% of each "cached" prompt (rounded down to whole chunks by the
connector), then a fresh `kv_consumer` (its local prefix cache off, so every cached token is
fetched from the pool) times, alternately after one warm-up pair, a cold prompt and a cached one.
TTFT is one `generate` call with `max_tokens=1`, from arrival to the first token.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import click

BLOCK_SIZE = 32  # vLLM's CPU attention backend takes multiples of 32


def vllm_python(explicit: str | None) -> str:
    """The interpreter that runs the engines: `explicit`, else .venv-vllm's (what `make test` builds:
    vLLM pins its own torch and transformers), else this one; it must find vLLM."""
    candidates = [explicit] if explicit else [str(Path(".venv-vllm/bin/python")), sys.executable]
    for python in candidates:
        if Path(python).exists() or python == sys.executable:
            probe = subprocess.run([python, "-c", "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)"])
            if probe.returncode == 0:
                return str(Path(python).absolute()) if Path(python).exists() else python
    raise click.UsageError(f"--engine vllm: no vLLM in {', '.join(candidates)} (`make test` builds .venv-vllm)")


def vllm_ttft(address: str, model_path: str, fingerprint: str, model_id: str, fresh_prompt: Callable[[], list[int]],
              tokens: int, reps: int, chunk_tokens: int, dtype: str, python: str) -> dict[str, Any]:
    """{"cold": [ms], "cached_90": [ms], "cached_tokens": n, "startup_s": s} of a fresh vLLM engine."""
    from kvpool.tools.vllm_run import run_engines

    extra = {"kvpool_address": address, "chunk_tokens": chunk_tokens, "model_id": model_id,
             "weights_fingerprint": fingerprint}
    pairs = [(fresh_prompt(), fresh_prompt()) for _ in range(reps + 1)]  # (cold, cached); pair 0 warms up
    base = {"dtype": dtype, "block_size": BLOCK_SIZE, "max_model_len": tokens + 64}
    run_engines(python=python, spec={"model": model_path, "engines": [
        {**base, "name": "producer", "connector": {**extra, "kv_role": "kv_producer"},
         "phases": [{"prompts": [c[: int(tokens * 0.9)] for _, c in pairs], "max_tokens": 1}]}]})
    order = [p for pair in pairs for p in pair]
    result = run_engines(python=python, spec={"model": model_path, "engines": [
        {**base, "name": "consumer", "connector": {**extra, "kv_role": "kv_consumer"},
         "phases": [{"prompts": order, "max_tokens": 1, "timed": True}]}]})
    consumer = result["engines"]["consumer"]
    ms, cached = consumer["phases"][0]["ms"], consumer["phases"][0]["cached_tokens"]
    return {"cold": ms[2::2], "cached_90": ms[3::2], "cached_tokens": cached[3], "cold_cached_tokens": cached[2],
            "startup_s": consumer["startup_s"], "stats": consumer["stats"]}
