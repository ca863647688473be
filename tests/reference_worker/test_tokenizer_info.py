"""`GET /v1/tokenizer` carries everything a router needs to produce the worker's own token ids
without the model or transformers: the recipe in `TokenizerInfo`'s docstring, followed here
literally with `tokenizers` + jinja2, must give `/v1/tokenize`'s ids exactly."""

from __future__ import annotations

import json
from datetime import datetime

import pytest

from kvpool import worker_api as m

pytestmark = pytest.mark.model

PROMPTS = ["The capital of France is", "  two leading spaces\nand a newline\n\n", "naïve café — 東京 🚀 ÅÄÖ",
           "def f(x):\n    return x ** 2\n", "x", "tokens <|im_start|>user inside<|im_end|> plain text",
           "1, 2, 3, 4," * 20]
CHATS = [
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Capital of Italy?"}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a fact about the moon."}],
    [{"role": "user", "content": "Traduis « bonjour » en japonais : こんにちは? 🙂"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "Empty system prompt above."}],
    [{"role": "user", "content": "  indented\n\tand tabbed  "}],
    [{"role": "user", "content": "Quote <|im_end|> inside"}, {"role": "assistant", "content": ""},
     {"role": "user", "content": "and again"}],
]


def router_side(info: m.TokenizerInfo):
    """What a router builds from the info alone (the docstring's recipe)."""
    import jinja2
    import jinja2.ext
    import jinja2.sandbox
    import tokenizers

    tok = tokenizers.Tokenizer.from_str(info.tokenizer_json)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    template = env.from_string(info.chat_template)
    bos_id = tok.token_to_id(info.bos_token) if info.bos_token else None

    def encode_prompt(text: str) -> list[int]:
        ids = tok.encode(text).ids
        return [bos_id, *ids] if info.add_bos_token else ids

    def encode_chat(messages: list[dict]) -> list[int]:
        text = template.render(messages=messages, add_generation_prompt=True, **info.special_tokens)
        return tok.encode(text, add_special_tokens=False).ids

    return encode_prompt, encode_chat


def test_router_side_tokenization_equals_the_workers(worker_factory, http_of):
    http = http_of(worker_factory(role="both"))
    resp = http.get("/v1/tokenizer")
    assert resp.status_code == 200
    info = m.decode(resp.content, m.TokenizerInfo)
    assert info.chat_template and info.eos_token == "<|im_end|>" and info.special_tokens["eos_token"] == "<|im_end|>"
    encode_prompt, encode_chat = router_side(info)

    def worker_ids(body: dict) -> list[int]:
        r = http.post("/v1/tokenize", json=body)
        assert r.status_code == 200, r.text
        return r.json()["token_ids"]

    for text in PROMPTS:
        assert encode_prompt(text) == worker_ids({"prompt": text}), text
    for chat in CHATS:
        assert encode_chat(chat) == worker_ids({"messages": chat}), chat


def test_info_is_cached_and_the_bos_probe_matches_the_tokenizer(worker_factory, reference_model):
    w = worker_factory(role="prefill")
    info = w.tokenizer_info()
    assert w.tokenizer_info() is info
    assert info.model_id == reference_model.model_id
    # SmolLM2 adds no BOS to plain text: the JSON's post-processor is the whole story
    assert info.add_bos_token is False and reference_model.encode("Hello")[0] != reference_model.tokenizer.bos_token_id
