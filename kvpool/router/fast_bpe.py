"""A second engine for the router's byte-level BPE: tiktoken's, taken only where it provably
gives the model's own ids. On an 8k-token prompt here it takes ~1 ms where the `tokenizers`
library takes ~10 ms, most of a cold route.

`fast_bpe(tokenizer_json)` returns the engine, or None and the reason it cannot be proven equal
(the router then keeps the `tokenizers` library alone). The engine is used only on ASCII text;
special tokens are cut out before it (RouterTokenizer does, as `tokenizers` does).

Why the ids are the same, not merely close:

1. Pre-tokens. Both libraries split the text with the same GPT-2 pattern (`tokenizers`'
   ByteLevel pre-tokenizer with Oniguruma, tiktoken with fancy-regex; both leftmost-first).
   They can only differ in what `\\p{L}`, `\\p{N}` and `\\s` contain, which on ASCII text is the
   same in both: `[A-Za-z]`, `[0-9]`, `[\\t\\n\\v\\f\\r ]`. Hence ASCII only (`str.isascii` is O(1)).
2. BPE of one pre-token. `tokenizers` applies the merge (a, b) of lowest index in the merges
   list, leftmost first, until none applies. tiktoken joins the adjacent pair whose
   concatenation has the lowest rank (here: the token id), leftmost first, and takes a
   pre-token that is itself a token at once. The checks below establish that the vocabulary is
   what one BPE training produces:
   (a) each token of two or more bytes is the result of exactly one merge, each merge result is
       a token, and ids grow with the merge index: ranks order merges as their indices do;
   (b) the two parts of a merge have lower ids than its result: `tokenizers` applies merges in
       order of index;
   (c) each token, tokenized alone by `tokenizers`, is itself: the shortcut agrees.
   The two could then only part where tiktoken joins a pair (a, b) whose concatenation t is a
   token made by another merge (c, d) of index k, nothing below k being left to merge. No merge
   crossed that span's edges (a token is never split again), so inside it `tokenizers` has run
   exactly the merges it runs on t alone, in the same order; by (b) and (c) the first state of
   t's own run with nothing below k to merge is [c, d], its last step being merge k. So the
   span holds [c, d], not [a, b]: they never part.
The tests compare the two on random and real text (tests/kvpool/router/test_fast_bpe.py).
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, NamedTuple

# The ByteLevel pre-tokenizer's pattern, as `tokenizers` compiles it (use_regex=True).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _byte_of_char() -> dict[str, int]:
    """ByteLevel's alphabet: which byte each of its 256 printable characters stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


def _is_plain_byte_level(pre: Any) -> bool:
    if isinstance(pre, dict) and pre.get("type") == "Sequence" and len(pre.get("pretokenizers") or []) == 1:
        pre = pre["pretokenizers"][0]
    return (isinstance(pre, dict) and pre.get("type") == "ByteLevel" and pre.get("use_regex", True) is True
            and not pre.get("add_prefix_space", False))


class FastBPE(NamedTuple):
    """`encode(text)` gives exactly the model's ids for a text without special tokens for which
    `takes(text)` is true (ASCII, without a byte the vocabulary lacks)."""

    encode: Callable[[str], list[int]]
    absent: re.Pattern[str] | None

    def takes(self, text: str) -> bool:
        return text.isascii() and (self.absent is None or self.absent.search(text) is None)


def fast_bpe(tokenizer_json: str) -> tuple[FastBPE | None, str]:
    """(the engine, "") or (None, why it cannot be proven equal to the model's tokenizer)."""
    try:
        import tiktoken
    except ImportError:
        return None, "tiktoken is not installed"
    spec = json.loads(tokenizer_json)
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return None, f"the model is {model.get('type')}, not BPE"
    if spec.get("normalizer") is not None:
        return None, "the tokenizer normalizes text first"
    if not _is_plain_byte_level(spec.get("pre_tokenizer")):
        return None, "the pre-tokenizer is not plain ByteLevel"
    if model.get("dropout") or model.get("byte_fallback") or model.get("continuing_subword_prefix") \
            or model.get("end_of_word_suffix"):
        return None, "the BPE model has dropout, byte fallback or subword affixes"
    added = spec.get("added_tokens") or []
    if any(not t.get("special") or t.get("lstrip") or t.get("rstrip") or t.get("single_word") for t in added):
        return None, "an added token is not a plain special token"
    vocab: dict[str, int] = model.get("vocab") or {}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model.get("merges") or []]
    specials = {t["content"] for t in added}
    byte_of = _byte_of_char()
    # ASCII bytes a vocabulary lacks (control characters, in some) are dropped by `tokenizers`;
    # tiktoken cannot encode them: text with one stays with `tokenizers`.
    absent = sorted(b for c, b in byte_of.items() if b < 128 and c not in vocab)
    made_by: dict[str, int] = {}
    last_id = -1
    for index, pair in enumerate(merges):
        if len(pair) != 2:
            return None, f"merge {index} is not a pair"
        a, b = pair
        result = a + b
        token_id = vocab.get(result)
        if token_id is None or a not in vocab or b not in vocab:
            return None, f"merge {index} ({a!r}, {b!r}) is not in the vocabulary"
        if result in made_by:
            return None, f"{result!r} is made by two merges"  # (a)
        if token_id <= last_id:
            return None, f"ids do not grow with the merge index at merge {index}"  # (a)
        if vocab[a] >= token_id or vocab[b] >= token_id:
            return None, f"merge {index} uses a token made after it"  # (b)
        made_by[result] = index
        last_id = token_id
    ranks: dict[bytes, int] = {}
    for token, token_id in vocab.items():
        if token in specials:
            continue
        if len(token) > 1 and token not in made_by:
            return None, f"{token!r} is no merge's result"  # (a)
        try:
            ranks[bytes(byte_of[c] for c in token)] = token_id
        except KeyError:
            return None, f"{token!r} is not in ByteLevel's alphabet"
    if any(t in made_by for t in specials):
        return None, "a special token is also a merge result"
    if len(set(ranks.values())) != len(ranks):
        return None, "two tokens share an id"
    if not model.get("ignore_merges"):
        import tokenizers

        bpe = tokenizers.Tokenizer.from_str(tokenizer_json).model
        for token in made_by:  # (c); single bytes are themselves trivially
            pieces = bpe.tokenize(token)
            if len(pieces) != 1:
                return None, f"{token!r} alone does not tokenize to itself"
    try:
        encoding = tiktoken.Encoding("kvpool-router", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={})
    except Exception as exc:  # a tiktoken that takes these ranks otherwise: the tokenizers library alone
        return None, f"tiktoken refused the vocabulary: {type(exc).__name__}: {exc}"
    absent_re = re.compile("[" + "".join(re.escape(chr(b)) for b in absent) + "]") if absent else None
    return FastBPE(encoding.encode_ordinary, absent_re), ""
