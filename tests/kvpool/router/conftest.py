"""Fixtures shared by the router's tokenizer tests: the model's own tokenizer (transformers), the
router's cached one over it (a cache small enough to evict, and a big one), and the model's own chat
ids, which every fast path must equal."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoTokenizer

    from reference_worker.model import reference_model_path

    return AutoTokenizer.from_pretrained(reference_model_path())


@pytest.fixture(params=[(64, True), (200_000, True), (64, False)], ids=["tiny-cache", "big-cache", "no-tiktoken"])
def rt(hf, request):
    """With the fast engine for ASCII text (kvpool/router/fast_bpe.py) and without it (the
    sentence cache over the `tokenizers` library for all text)."""
    from kvpool.router.tokenizer import RouterTokenizer

    cache_entries, fast = request.param
    tok = RouterTokenizer(hf.backend_tokenizer.to_str(), hf.chat_template, bos_token=hf.bos_token,
                          eos_token=hf.eos_token, cache_entries=cache_entries, fast=fast)
    assert (tok._fast is not None) == fast
    return tok


@pytest.fixture(scope="module")
def chat_ids(hf):
    """`chat_ids(messages)`: transformers' chat template, tokenized: the ids to equal."""
    def ids(messages):
        out = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)
    return ids
