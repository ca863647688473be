"""The units of work the scheduler runs: a prefill job (compute the uncached part of a prompt)
and a decode sequence (one token per step until a stop token or the token budget).

Both hold a batch-1 `DynamicCache` that only the scheduler thread mutates once submitted.
Results leave through callbacks that must be thread-safe (the HTTP layer posts them onto its
event loop).
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class PrefillJob:
    """Run `token_ids[cursor:]` on top of `cache` (which holds token_ids[:cursor])."""

    request_id: str
    token_ids: list[int]
    cache: Any
    cursor: int
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    logits: Any = None
    sampling: Any = None  # messages.SamplingParams; None: greedy. Picks token 0 of the request.
    compute_s: float = 0.0  # forward time spent on this job's chunks (queue wait and decode steps excluded)

    @property
    def remaining(self) -> int:
        return len(self.token_ids) - self.cursor

    @property
    def computed_tokens(self) -> int:
        return len(self.token_ids) - self._start

    def __post_init__(self) -> None:
        self._start = self.cursor
        if not 0 <= self.cursor < len(self.token_ids):
            raise ValueError("a prefill job must leave at least one token to compute")


# emit(token_id, finish_reason, error): token_id is None on an error or a bare finish
Emit = Callable[[int | None, str | None, BaseException | None], None]


@dataclass
class DecodeSequence:
    """Feed `next_token`, pick the next (argmax, or sampled per `sampling`), until a stop id or
    `remaining` is 0. The token a step picks is position `generated + 1` of the request (0 was
    the prefill's), which is what seeds its draw."""

    request_id: str
    cache: Any
    next_token: int
    remaining: int
    stop_ids: frozenset[int]
    emit: Emit
    cancelled: bool = False
    finished: bool = False
    generated: int = 0
    sampling: Any = None  # messages.SamplingParams; None: greedy

    @property
    def next_index(self) -> int:
        return self.generated + 1

    @property
    def kv_tokens(self) -> int:
        return int(self.cache.get_seq_length())
