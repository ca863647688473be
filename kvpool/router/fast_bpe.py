r"""A second engine for the router's byte-level BPE: tiktoken's, taken only where it provably
gives the model's own ids. On an 8k-token prompt here it takes ~1 ms where the `tokenizers`
library takes ~10 ms, most of a cold route (CJK text: 2.6 vs 38 ms).

`fast_bpe(tokenizer_json)` returns the engine, or None and the reason it cannot be proven equal
(the router then keeps the `tokenizers` library alone). `FastBPE.takes(text)` says whether the
engine may encode a text; special tokens are cut out before it (RouterTokenizer does, as
`tokenizers` does).

Why the ids are the same, not merely close:

1. Pre-tokens. Both libraries split the text with the same GPT-2 pattern (`tokenizers`'
   ByteLevel pre-tokenizer with Oniguruma, tiktoken with fancy-regex; both leftmost-first).
   They can only differ in which characters `\p{L}`, `\p{N}` and `\s` contain (their Unicode
   tables). On ASCII text that is the same in any version: `[A-Za-z]`, `[0-9]`,
   `[\t\n\v\f\r ]`. For other text, a sweep over every code point
   (tests/kvpool/router/test_fast_bpe.py, slow) showed the two libraries put each one in the same
   class. That holds for the versions swept, so other text is taken only with the exact pairs
   of versions in `UNICODE_SWEPT`. Lone surrogates are never taken: the libraries treat them
   differently.
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
from typing import Any, Callable

# The ByteLevel pre-tokenizer's pattern, as `tokenizers` compiles it (use_regex=True).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# (tokenizers, tiktoken) versions whose regex engines put every code point in the same class
# (`test_every_code_point_is_in_the_same_class`, marked slow: ~2 min). With other versions the
# engine takes ASCII text only.
UNICODE_SWEPT = {("0.23.3", "0.14.0")}


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


class FastBPE:
    """`encode(text)` gives exactly the model's ids for a text without special tokens for which
    `takes(text)` is true: ASCII (or, with `any_text`, any text) whose UTF-8 holds no byte the
    vocabulary lacks, and no lone surrogate."""

    __slots__ = ("encode", "absent", "any_text", "_absent_ascii")

    def __init__(self, encode: Callable[[str], list[int]], absent: tuple[bytes, ...], any_text: bool):
        self.encode = encode
        self.absent = absent  # single bytes the vocabulary lacks (only those UTF-8 can hold)
        self.any_text = any_text
        self._absent_ascii = tuple(chr(b[0]) for b in absent if b[0] < 0x80)

    def takes(self, text: str) -> bool:
        if text.isascii():  # O(1) in CPython; each `in` below is a memchr
            return not any(c in text for c in self._absent_ascii)
        if not self.any_text:
            return False
        try:
            data = text.encode()
        except UnicodeEncodeError:  # a lone surrogate
            return False
        return not any(b in data for b in self.absent)


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
    # Bytes a vocabulary lacks (ASCII control characters, and lead bytes of unused planes, in
    # some) are dropped by `tokenizers`; tiktoken cannot encode them: text with one stays there.
    absent = sorted(b for c, b in byte_of.items() if c not in vocab)
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
    import tokenizers

    if not model.get("ignore_merges"):
        bpe = tokenizers.Tokenizer.from_str(tokenizer_json).model
        for token in made_by:  # (c); single bytes are themselves trivially
            pieces = bpe.tokenize(token)
            if len(pieces) != 1:
                return None, f"{token!r} alone does not tokenize to itself"
    try:
        encoding = tiktoken.Encoding("kvpool-router", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={})
    except Exception as exc:  # a tiktoken that takes these ranks otherwise: the tokenizers library alone
        return None, f"tiktoken refused the vocabulary: {type(exc).__name__}: {exc}"
    versions = (getattr(tokenizers, "__version__", ""), getattr(tiktoken, "__version__", ""))
    in_utf8 = tuple(bytes([b]) for b in absent if b not in (0xC0, 0xC1) and b < 0xF5)
    return FastBPE(encoding.encode_ordinary, in_utf8, versions in UNICODE_SWEPT), ""
