"""The router's tokenizer: the model's own `tokenizers` JSON and chat template, fetched from a
worker (`GET /v1/tokenizer`), so the router needs neither the model nor transformers and its
token ids are the worker's (tests compare them).

Speed: a long prompt costs ~1.2 us per token in the `tokenizers` library, too slow for a router
that must decide in a few ms. Two remedies:
- new text goes to tiktoken's BPE engine, ~10x faster, built from the same vocabulary and
  merges where it provably gives the same ids (kvpool/router/fast_bpe.py says why and which
  text it takes: ASCII always, other text with the library versions swept for it);
- prompts repeat (system prompts, documents, earlier chat turns), so ids are cached: each
  segment between special tokens (with a chat template, one message) and, inside a new segment
  that the fast engine does not take, each sentence. Only new sentences are encoded, in one
  parallel batch. The cuts give exactly the ids of the whole text: special tokens split the
  text before BPE runs, and sentences are cut just before a space that follows a sentence end
  and precedes a letter, a pre-token boundary of the byte-level pre-tokenizer, which BPE never
  merges across. The tests check the equality on real prompts and random text.

Cached ids are kept as little-endian u32 bytes: `encode_prompt` hands the router the bytes its
chunk keys hash (`Prompt.u32`) as one join of cached pieces, and the collector has nothing to
walk in the caches.
"""

from __future__ import annotations

import array
import datetime
import json
import logging
import re
import sys
from typing import Any, NamedTuple, Sequence

from kvpool.errors import InvalidArgument
from kvpool.router.fast_bpe import fast_bpe

log = logging.getLogger(__name__)

# A sentence end, then the space that starts the next word: ". The", "? And", "\nSection".
_CUT = re.compile(r"(?<=[.!?:;\n])(?= [A-Za-z])")
_SERIAL_CHARS = 4096  # new text up to this long is encoded serially (see encode_prompt)


class _Cache:
    """Approximate LRU in two generations: hits move an entry to the young one; when the young
    one is full it becomes the old one and the old one is dropped. A lookup is one or two dict
    reads (no lock: each operation is a single dict call, atomic under the GIL). Values are
    bytes (ids as little-endian u32), which the garbage collector never tracks: hundreds of
    thousands of cached lists, or young 8k-id tuples waiting for their first collection, would
    make collections pauses of many ms in the routing path."""

    def __init__(self, capacity: int):
        self.half = max(1, capacity // 2)
        self._young: dict[str, Any] = {}
        self._old: dict[str, Any] = {}

    def get(self, key: str) -> Any:
        value = self._young.get(key)
        if value is None:
            value = self._old.get(key)
            if value is not None:
                self.put(key, value)
        return value

    def put(self, key: str, value: Any) -> None:
        if len(self._young) >= self.half:
            self._old, self._young = self._young, {}
        self._young[key] = value


class Prompt(NamedTuple):
    """A prompt's token ids, and the same ids as little-endian u32 bytes (what its chunk keys
    hash: `kvpool.keys.chunk_keys_hex_u32`)."""

    ids: list[int]
    u32: bytes


def u32_bytes(ids: Sequence[int]) -> bytes:
    """Token ids as little-endian u32 bytes (`OverflowError`, `TypeError`: not u32 ids)."""
    return _u32(ids).tobytes()


def _ids(u32: bytes) -> list[int]:
    return _u32(u32).tolist()


def _u32(values: Any) -> array.array:
    """An array of C unsigned ints, 4 bytes on every platform CPython runs on, little-endian."""
    arr = array.array("I", values)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr


class RouterTokenizer:
    def __init__(self, tokenizer_json: str, chat_template: str | None, *, bos_token: str | None = None,
                 eos_token: str | None = None, add_bos_token: bool = False,
                 special_tokens: dict[str, str] | None = None, cache_entries: int = 200_000,
                 fast: bool = True):
        import jinja2.sandbox
        import tokenizers

        self._tok = tokenizers.Tokenizer.from_str(tokenizer_json)
        try:
            self._fast, why = fast_bpe(tokenizer_json) if fast else (None, "turned off")
        except Exception as exc:  # an odd tokenizer JSON: the checks could not even run
            self._fast, why = None, f"its checks failed: {type(exc).__name__}: {exc}"
        log.info("router tokenizer: %s", (f"tiktoken for {'all' if self._fast.any_text else 'ASCII'} text (proven "
                 "to give the same ids), the tokenizers library for the rest") if self._fast is not None
                 else f"the tokenizers library alone ({why})")
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos_token = add_bos_token
        specials = sorted((t.content for t in self._tok.get_added_tokens_decoder().values() if t.special),
                          key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, specials)) + ")") if specials else None
        self._special_u32 = {s: u32_bytes([self._tok.token_to_id(s)]) for s in specials}
        self._sentences = _Cache(cache_entries)
        self._segments = _Cache(cache_entries // 16)
        # The template sees the special tokens by name (bos_token, eos_token, ...), as in transformers.
        self._template_vars = {"bos_token": bos_token or "", "eos_token": eos_token or "", **(special_tokens or {})}
        self._template = None
        if chat_template:  # compiled as transformers' apply_chat_template compiles it
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                               extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            self._template = env.from_string(chat_template)

    @classmethod
    def from_info(cls, info: Any) -> "RouterTokenizer":
        """From a worker's `TokenizerInfo`."""
        return cls(info.tokenizer_json, info.chat_template, bos_token=info.bos_token, eos_token=info.eos_token,
                   add_bos_token=info.add_bos_token, special_tokens=info.special_tokens)

    # -- text -> ids ---------------------------------------------------------------------------
    def render_chat(self, messages: Sequence[dict[str, Any]]) -> str:
        if self._template is None:
            raise InvalidArgument("this model has no chat template; use /v1/completions")
        return self._template.render(messages=list(messages), add_generation_prompt=True,
                                     **self._template_vars)

    def encode_chat_prompt(self, messages: Sequence[dict[str, Any]]) -> Prompt:
        """Ids of the conversation rendered with the chat template (no extra special tokens: the
        template writes its own markers), as `apply_chat_template(tokenize=True)` gives them."""
        return self.encode_prompt(self.render_chat(messages), False)

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> Prompt:
        """The text's ids, as the `tokenizers` library gives them (with BOS, if the model adds it)."""
        segments = [p for p in (self._split.split(text) if self._split is not None else [text]) if p]
        specials = self._special_u32
        found: dict[str, bytes | None] = {}
        new = []
        for g in segments:
            if g not in found and g not in specials:
                found[g] = hit = self._segments.get(g)
                if hit is None:
                    new.append(g)
        new = self._fast_encode(new, found, self._segments)  # new segments it takes, whole
        if new:
            sentences = {g: [p for p in _CUT.split(g) if p] for g in new}
            have = {p: self._sentences.get(p) for ps in sentences.values() for p in ps}
            # a segment it does not take: the sentences it does
            missing = self._fast_encode([p for p, v in have.items() if v is None], have, self._sentences)
            if missing:
                # A few new sentences (a new chat turn) are encoded on this thread: the parallel
                # batch wakes the tokenizer's thread pool, whose hand-off costs as much CPU as the
                # work and, on a busy machine, a wait for those threads to be scheduled.
                if sum(map(len, missing)) <= _SERIAL_CHARS:
                    encs = [self._tok.encode(piece, add_special_tokens=False) for piece in missing]
                else:
                    encs = self._tok.encode_batch_fast(missing, add_special_tokens=False)
                for piece, enc in zip(missing, encs):
                    have[piece] = u32_bytes(enc.ids)
                    self._sentences.put(piece, have[piece])
            for g, ps in sentences.items():
                found[g] = b"".join(have[p] for p in ps)
                self._segments.put(g, found[g])
        parts: list[bytes] = []
        if add_special_tokens and self.add_bos_token and self.bos_token is not None:
            parts.append(u32_bytes([self._tok.token_to_id(self.bos_token)]))
        for g in segments:
            special = specials.get(g)
            parts.append(special if special is not None else found[g])
        u32 = b"".join(parts)
        return Prompt(_ids(u32), u32)

    def _fast_encode(self, texts: list[str], into: dict[str, bytes | None], cache: _Cache) -> list[str]:
        """Encodes those of `texts` the fast engine takes (~0.15 us/token) into `into` and `cache`;
        returns the others."""
        rest = []
        for text in texts:
            if self._fast is not None and self._fast.takes(text):
                into[text] = u32_bytes(self._fast.encode(text))
                cache.put(text, into[text])
            else:
                rest.append(text)
        return rest

    def encode_uncached(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The whole text in one call, no cache: the reference the cached path must equal."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token is not None:
            ids = [self._tok.token_to_id(self.bos_token), *ids]
        return ids


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' `tojson`: plain json.dumps (jinja's own escapes <, >, & and ', changing the text)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _raise_exception(message: str) -> None:
    raise InvalidArgument(f"the chat template refused the conversation: {message}")
