"""Tenants behind real vLLM servers: `kvpool up --engine vllm --auth-file KEYRING` with two API keys
mapped to two tenants. The router sends each tenant's requests with its own `cache_salt`; the
connector keys their chunks in the namespace salted with it, so one tenant's cached prompt is no
pool hit (and no timing oracle) for the other.

One colocated server (kv_both) with vLLM's own prefix cache off, so `cached_tokens` counts exactly
the prompt tokens loaded from the pool. float32: greedy text is bit-stable whatever is cached.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
from kvpool.tools.launch.processes import clean_env

# slow: a `kvpool up --engine vllm` of its own (~2.5 min); the router salting each tenant's
# requests is checked in the default suite (tests/kvpool/router/test_router_vllm_tenants.py).
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed here: `make test` runs this suite in .venv-vllm")]

MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
CHUNK, MAX_TOKENS = 256, 16
PROMPT = (Path(__file__).parents[3] / "docs" / "router.md").read_text()[:2600]  # ~600 tokens: two full chunks
API_KEYS = {"acme": "sk-acme-0123456789abcdef", "beta": "sk-beta-0123456789abcdef"}


def loadable(n: int) -> int:
    """Prompt tokens loadable from the pool: whole chunks, leaving one token to compute."""
    return (n - 1) // CHUNK * CHUNK


@pytest.fixture(scope="module")
def router_url(model_path, tmp_path_factory, kvpool_up_vllm):
    workdir = tmp_path_factory.mktemp("up-vllm-tenants")
    keyring = workdir / "keyring.json"
    keyring.write_text(json.dumps({"principals": {
        "node": {"role": "node", "secret": "n" * 40},
        **{t: {"role": f"tenant:{t}", "secret": t[0] * 40, "api_keys": [key]} for t, key in API_KEYS.items()}}}))
    os.chmod(keyring, 0o600)
    env = clean_env()
    with kvpool_up_vllm(["--colocated", "1", "--set", "up.vllm_dtype=float32", "--port", "0", "--auth-file", str(keyring),
                         "--vllm-arg=--max-model-len=1024", "--vllm-arg=--no-enable-prefix-caching"],
                        workdir, env) as url:
        yield url


def complete(router_url: str, tenant: str):
    from openai import OpenAI

    client = OpenAI(base_url=router_url + "/v1", api_key=API_KEYS[tenant], max_retries=0, timeout=300)
    r = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    return r.choices[0].text, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens


def test_a_tenants_cached_prompt_is_no_hit_for_another_tenant(router_url):
    text_a, n, cached = complete(router_url, "acme")
    assert n > 2 * CHUNK and cached == 0, "cold: nothing cached anywhere"
    text_b, _, cached = complete(router_url, "beta")
    assert cached == 0, "beta's identical prompt finds none of acme's chunks"
    assert text_b == text_a
    text, _, cached = complete(router_url, "acme")
    assert cached == loadable(n), "acme's repeat loads acme's chunks from the pool"
    assert text == text_a
    text, _, cached = complete(router_url, "beta")
    assert cached == loadable(n), "beta's repeat loads the chunks beta's first request saved"
    assert text == text_a
