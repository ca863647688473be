"""Incremental text of a decode stream: what each new token adds to the text so far."""

from __future__ import annotations

from typing import Any


class Detokenizer:
    """Incremental text of a growing token list (holds back a partial UTF-8 character)."""

    def __init__(self, tokenizer: Any, first: list[int]):
        self.tokenizer = tokenizer
        self.ids = list(first)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd") or not text.startswith(self.text):
            return ""
        delta, self.text = text[len(self.text):], text
        return delta
