"""Run real vLLM engines, one after another, in a process of their own.

The real-engine tests (tests/engine_adapters/vllm_real) and `kvpool bench adapter --engine vllm`
start engines through `run_engines(spec)`: a fresh Python process (`python -m
kvpool.tools.vllm_run`) builds each engine of the spec in turn as an in-process `vllm.LLM` (no
engine-core subprocess), runs its phases, shuts it down, and prints one JSON result line at the
end. Each engine is fresh: its KV cache, scheduler and connector instances are new (vLLM's local
prefix cache is off unless asked for); only the process, and so vLLM's import, is shared.

A spec is a dict: `model` (a local transformers folder) and `engines`, a list of dicts with
`name`, `dtype`, `block_size`, `max_model_len`, `connector` (None, or the `kv_connector_extra_config`
plus `kv_role` and `kv_load_failure_policy`, default "recompute") and `phases`: each a list of
`prompts` (token-id lists, or strings that vLLM tokenizes) with `max_tokens`; `timed` phases also
report the wall time of each prompt, run one at a time (time to first token when `max_tokens` is 1).
A phase's result holds each prompt's generated token ids and text.

vLLM reads its settings from the environment at import, so the child gets them before importing
it: CPU KV space (`VLLM_CPU_KVCACHE_SPACE`, GiB), the OpenMP cores (`VLLM_CPU_OMP_THREADS_BIND`,
a range such as `0-1`), and `VLLM_ENABLE_V1_MULTIPROCESSING=0`. vLLM may spawn, so this module
only runs engines under its `__main__` guard.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

RESULT_MARK = "KVPOOL_VLLM_RESULT "


def engine_env(kv_space_gib: int = 1, cores: int | None = None) -> dict[str, str]:
    """The environment of an in-process CPU vLLM engine: small KV space, OpenMP on the first cores."""
    cores = cores or min(2, os.cpu_count() or 1)
    env = dict(os.environ)
    env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib),
                "VLLM_CPU_OMP_THREADS_BIND": "0" if cores == 1 else f"0-{cores - 1}",
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"})
    return env


def run_engines(spec: dict[str, Any], *, python: str | None = None, timeout_s: float = 900,
                env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `spec` in a fresh process of `python` (default: this interpreter; it needs vLLM and this
    package): {"import_s", "engines": {name: result}}, or RuntimeError with the child's log tail."""
    proc = subprocess.run([python or sys.executable, "-m", "kvpool.tools.vllm_run"], input=json.dumps(spec), text=True,
                          capture_output=True, timeout=timeout_s, env=env or engine_env())
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    tail = (proc.stdout + proc.stderr)[-6000:]
    raise RuntimeError(f"vLLM engine process exited with {proc.returncode} and no result:\n{tail}")


def _connector_config(connector: dict[str, Any]) -> Any:
    from vllm.config import KVTransferConfig

    extra = dict(connector)
    role = extra.pop("kv_role", "kv_both")
    # a chunk that is gone or damaged at load time is recomputed (vLLM 0.32's default fails the request)
    policy = extra.pop("kv_load_failure_policy", "recompute")
    return KVTransferConfig(kv_connector="KVPoolConnector", kv_connector_module_path="engine_adapters.vllm",
                            kv_role=role, kv_connector_extra_config=extra, kv_load_failure_policy=policy)


def _connector_stats() -> dict[str, int] | None:
    """The worker-side connector's counters (the worker runs in this process)."""
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    except ImportError:
        return None
    if not has_kv_transfer_group():
        return None
    connector = get_kv_transfer_group()
    return {**(getattr(connector, "stats", None) or {}), "paged_layout": getattr(connector, "paged_layout", None)}


def _run(spec: dict[str, Any]) -> dict[str, Any]:
    began = time.perf_counter()
    import vllm  # noqa: F401 - timed apart from the engines

    result: dict[str, Any] = {"import_s": time.perf_counter() - began, "engines": {}}
    for engine in spec["engines"]:
        result["engines"][engine["name"]] = _run_engine(spec["model"], engine)
    return result


def _run_engine(model: str, engine: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    kwargs: dict[str, Any] = dict(model=model, dtype=engine.get("dtype", "bfloat16"),
                                  block_size=engine.get("block_size", 32), max_model_len=engine.get("max_model_len", 2048),
                                  enforce_eager=True, seed=0, enable_prefix_caching=engine.get("prefix_caching", False))
    if engine.get("connector") is not None:
        kwargs["kv_transfer_config"] = _connector_config(engine["connector"])
    llm = LLM(**kwargs)
    result: dict[str, Any] = {"startup_s": time.perf_counter() - started, "phases": []}
    try:
        for phase in engine["phases"]:
            result["phases"].append(_run_phase(llm, SamplingParams, phase))
        result["stats"] = _connector_stats()
    finally:  # the worker's connector shuts down with the engine (async saves end first)
        llm.llm_engine.engine_core.shutdown()
    return result


def _run_phase(llm: Any, sampling_params: Any, phase: dict[str, Any]) -> dict[str, Any]:
    started = time.perf_counter()
    params = sampling_params(temperature=0.0, max_tokens=phase.get("max_tokens", 16), logprobs=2)
    prompts = [{"prompt": p} if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in phase["prompts"]]
    times = []
    if phase.get("timed"):
        outputs = []
        for prompt in prompts:
            t0 = time.perf_counter()
            outputs += llm.generate([prompt], params, use_tqdm=False)
            times.append((time.perf_counter() - t0) * 1e3)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    return {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "texts": [o.outputs[0].text for o in outputs],
            "prompt_token_ids": [list(o.prompt_token_ids or []) for o in outputs],
            "margins": [[_margin(step) for step in (o.outputs[0].logprobs or [])] for o in outputs],
            "cached_tokens": [o.num_cached_tokens for o in outputs],
            "kv_transfer_params": [o.kv_transfer_params for o in outputs],
            "ms": times, "s": time.perf_counter() - started}


def _margin(step: dict[int, Any]) -> float | None:
    """Top-1 minus top-2 logprob at one generated step (a near tie explains a greedy flip)."""
    ranked = sorted((lp for lp in step.values() if getattr(lp, "rank", None) in (1, 2)), key=lambda lp: lp.rank)
    return float(ranked[0].logprob - ranked[1].logprob) if len(ranked) == 2 else None


if __name__ == "__main__":
    print(RESULT_MARK + json.dumps(_run(json.loads(sys.stdin.read()))), flush=True)
    # Every engine was shut down (its connector's saves ended); skip vLLM's seconds of interpreter teardown.
    os._exit(0)
