"""P/D with real vLLM servers behind the kvpool router: `kvpool up --engine vllm --prefill 1
--decode 1` starts the pool, a vLLM prefill server (kv_producer) and a vLLM decode server
(kv_consumer) with the kvpool connector, and the router in front (`--engine vllm`); the official
`openai` client talks to the router.

The reference is a plain vLLM engine (no connector) given the same prompt text, run first and
alone (at most two engines are alive at once: ~6.5 GB each). float32, so a partly loaded prompt
gives bit-identical greedy tokens (docs/vllm.md, Limits). Checked: the text equals the plain
engine's; usage reports the prompt's full chunks as cached (the decode server loaded them from the
pool, which the prefill server filled); the first requests really went through the prefill server;
the router's own pool lookup sees the chunks the servers wrote (same key namespace).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed here: `make test` runs this suite in .venv-vllm")]

MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
CHUNK, MAX_TOKENS = 256, 16  # kvpool up's default chunk size
MAX_MODEL_LEN = 1024  # a short warm-up run at engine start
DOCS = Path(__file__).parents[3] / "docs"
PROMPT = (DOCS / "router.md").read_text()[:2600]  # natural text, ~600 tokens: two full chunks
SYSTEM = (DOCS / "sglang.md").read_text()[:2400]
QUESTION = "Summarize the page above in one sentence."


def loadable(n: int) -> int:
    """Prompt tokens a kv_consumer loads from the pool: whole chunks, leaving one token to compute."""
    return (n - 1) // CHUNK * CHUNK


def chat_text(model_path) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path))
    return tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
                                   tokenize=False, add_generation_prompt=True)


@pytest.fixture(scope="module")
def plain(model_path):
    """A plain vLLM engine's greedy output on the completion prompt and on the rendered chat."""
    from kvpool.tools.vllm_run import run_engines

    engine = {"name": "plain", "dtype": "float32", "block_size": 32, "max_model_len": MAX_MODEL_LEN, "connector": None,
              "phases": [{"prompts": [PROMPT, chat_text(model_path)], "max_tokens": MAX_TOKENS}]}
    result = run_engines({"model": str(model_path), "engines": [engine]})
    print(f"plain engine: import {result['import_s']:.0f} s, start {result['engines']['plain']['startup_s']:.0f} s")
    phase = result["engines"]["plain"]["phases"][0]
    return {"completion": (phase["texts"][0], len(phase["prompt_token_ids"][0])),
            "chat": (phase["texts"][1], len(phase["prompt_token_ids"][1]))}


@pytest.fixture(scope="module")
def router_url(plain, tmp_path_factory, kvpool_up_vllm):
    """`kvpool up --engine vllm --prefill 1 --decode 1` (after the plain engine is gone)."""
    workdir = tmp_path_factory.mktemp("up-vllm")
    with kvpool_up_vllm(["--prefill", "1", "--decode", "1", "--set", "up.vllm_dtype=float32", "--port", "0",
                         f"--vllm-arg=--max-model-len={MAX_MODEL_LEN}"], workdir) as url:
        yield url


@pytest.fixture(scope="module")
def client(router_url):
    from openai import OpenAI

    return OpenAI(base_url=router_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def served(router_url) -> dict[str, int]:
    import httpx

    workers = httpx.get(router_url + "/admin/workers", timeout=10).json()["workers"]
    return {w["role"]: w["served"] for w in workers}


def test_completion_through_prefill_and_decode_equals_plain_vllm(client, router_url, plain):
    text, n = plain["completion"]
    r = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert r.usage.prompt_tokens == n, "the router tokenizes as vLLM does"
    assert r.choices[0].text == text
    assert r.usage.completion_tokens == MAX_TOKENS
    assert r.usage.prompt_tokens_details.cached_tokens == loadable(n), "the decode server loaded the prefill's chunks"
    assert served(router_url)["prefill"] == 1, "a cold prompt this long is prefilled on the prefill server"


def test_streamed_chat_equals_plain_vllm(client, router_url, plain):
    text, n = plain["chat"]
    stream = client.chat.completions.create(
        model=MODEL_ID, max_tokens=MAX_TOKENS, temperature=0, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    pieces, usage = [], None
    for chunk in stream:
        usage = chunk.usage or usage
        pieces += [c.delta.content or "" for c in chunk.choices]
    assert "".join(pieces) == text
    assert usage.prompt_tokens == n
    assert usage.prompt_tokens_details.cached_tokens == loadable(n)
    assert served(router_url)["prefill"] == 2


def test_cached_prompt_is_found_by_the_router_and_loaded(client, router_url, plain):
    """The router hashes prompts into the connector's key space: its pool lookup sees the chunks the
    prefill server wrote. The repeat (routed wherever the policy likes) gives the same text."""
    import httpx

    text, n = plain["completion"]
    route = httpx.get(router_url + "/admin/route", params={"prompt": PROMPT}, timeout=10).json()
    assert route["request"]["pool_prefix_chunks"] == loadable(n) // CHUNK, json.dumps(route)
    r = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == text
    # at least the pool's whole chunks; more where the server it landed on still holds the prompt's
    # blocks in vLLM's own prefix cache (800 of 828 tokens in 32-token blocks, beyond the 768 of
    # 256-token chunks); never the whole prompt: the last token is always computed
    assert loadable(n) <= r.usage.prompt_tokens_details.cached_tokens < n
