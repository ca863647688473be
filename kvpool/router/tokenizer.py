"""The router's tokenizer: the model's own `tokenizers` JSON and chat template, fetched from a
worker (`GET /v1/tokenizer`), so the router needs neither the model nor transformers and its
token ids are the worker's (tests compare them).

Speed: a long prompt costs ~1 us per token in the Rust tokenizer, too slow for a router that
must decide in a few ms. Prompts repeat (system prompts, documents, earlier chat turns), so the
text is cut into sentences at boundaries the byte-level pre-tokenizer never merges across (just
before a space that follows a sentence end and precedes a letter) and each sentence's ids are
cached (LRU). Only new sentences are encoded, in one parallel batch. Cutting there gives exactly
the ids of the whole text because byte-level BPE never merges across pre-token boundaries, and
special tokens (the chat template's markers) split the text before that; the tests check the
equality on real prompts and on random text.
"""

from __future__ import annotations

import collections
import re
import threading
from typing import Any, Sequence

from kvpool.errors import InvalidArgument

# A sentence end, then the space that starts the next word: ". The", "? And", "\nSection".
_CUT = re.compile(r"(?<=[.!?:;\n])(?= [A-Za-z])")


class _LRU:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._data: collections.OrderedDict[str, list[int]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> list[int] | None:
        with self._lock:
            value = self._data.get(key)
            if value is not None:
                self._data.move_to_end(key)
            return value

    def put(self, key: str, value: list[int]) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.capacity:
                self._data.popitem(last=False)


class RouterTokenizer:
    def __init__(self, tokenizer_json: str, chat_template: str | None, *, bos_token: str | None = None,
                 eos_token: str | None = None, add_bos_token: bool = False, cache_entries: int = 200_000):
        import jinja2.sandbox
        import tokenizers

        self._tok = tokenizers.Tokenizer.from_str(tokenizer_json)
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos_token = add_bos_token
        specials = sorted((t.content for t in self._tok.get_added_tokens_decoder().values() if t.special),
                          key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, specials)) + ")") if specials else None
        self._special_ids = {s: self._tok.token_to_id(s) for s in specials}
        self._cache = _LRU(cache_entries)
        self._template = None
        if chat_template:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_exception
            self._template = env.from_string(chat_template)

    @classmethod
    def from_info(cls, info: Any) -> "RouterTokenizer":
        """From a worker's `TokenizerInfo`."""
        return cls(info.tokenizer_json, info.chat_template, bos_token=info.bos_token, eos_token=info.eos_token,
                   add_bos_token=info.add_bos_token)

    # -- text -> ids ---------------------------------------------------------------------------
    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise InvalidArgument("this model has no chat template; use /v1/completions")
        return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Ids of the conversation rendered with the chat template (no extra special tokens: the
        template writes its own markers), as `apply_chat_template(tokenize=True)` gives them."""
        return self.encode(self.render_chat(messages), add_special_tokens=False)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        pieces = self._pieces(text)
        missing = [p for p in dict.fromkeys(pieces) if p not in self._special_ids and self._cache.get(p) is None]
        if missing:
            for piece, enc in zip(missing, self._tok.encode_batch_fast(missing, add_special_tokens=False)):
                self._cache.put(piece, enc.ids)
        ids: list[int] = []
        if add_special_tokens and self.add_bos_token and self.bos_token is not None:
            ids.append(self._tok.token_to_id(self.bos_token))
        for piece in pieces:
            special = self._special_ids.get(piece)
            if special is not None:
                ids.append(special)
                continue
            cached = self._cache.get(piece)
            if cached is None:  # evicted between the batch and here: encode it alone
                cached = self._tok.encode(piece, add_special_tokens=False).ids
            ids.extend(cached)
        return ids

    def encode_uncached(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The whole text in one call, no cache: the reference the cached path must equal."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token is not None:
            ids = [self._tok.token_to_id(self.bos_token), *ids]
        return ids

    def _pieces(self, text: str) -> list[str]:
        parts = self._split.split(text) if self._split is not None else [text]
        out: list[str] = []
        for part in parts:
            if not part:
                continue
            if part in self._special_ids:
                out.append(part)
            else:
                out.extend(p for p in _CUT.split(part) if p)
        return out

    # -- ids -> text ---------------------------------------------------------------------------
    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


def _raise_exception(message: str) -> None:
    raise InvalidArgument(f"the chat template refused the conversation: {message}")
