"""The units of work the engine runs: a prefill job (compute the uncached part of a prompt) and a
decode sequence (one token per step until a stop token or the token budget).

Each holds a `SequenceKV` that only the engine thread writes once submitted. Results leave
through a future (prefill) or a callback (decode) that must be thread-safe (the HTTP layer posts
them onto its event loop).
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import Any, Callable

from reference_worker.kv_cache import SequenceKV


@dataclass(eq=False)
class PrefillJob:
    """Run `token_ids[kv.length:]` on top of `kv` (which holds the cached prefix)."""

    request_id: str
    token_ids: list[int]
    kv: SequenceKV
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    logits: Any = None  # the last prompt position's, once computed
    sampling: Any = None  # messages.SamplingParams; None: greedy. Picks token 0 of the request.
    compute_s: float = 0.0  # its share of the steps it took part in (by tokens); queue wait excluded

    def __post_init__(self) -> None:
        self._start = self.kv.length
        if not 0 <= self._start < len(self.token_ids):
            raise ValueError("a prefill job must leave at least one token to compute")

    @property
    def cursor(self) -> int:
        return self.kv.length

    @property
    def remaining(self) -> int:
        return len(self.token_ids) - self.kv.length

    @property
    def computed_tokens(self) -> int:
        return len(self.token_ids) - self._start


# emit(token_id, finish_reason, error): token_id is None on an error or a bare finish
Emit = Callable[[int | None, str | None, BaseException | None], None]


@dataclass(eq=False)
class DecodeSequence:
    """Feed `next_token`, pick the next (argmax, or sampled per `sampling`), until a stop id or
    `remaining` is 0. The token a step picks is position `generated + 1` of the request (0 was
    the prefill's), which is what seeds its draw."""

    request_id: str
    kv: SequenceKV
    next_token: int
    remaining: int
    stop_ids: frozenset[int]
    emit: Emit
    cancelled: bool = False
    finished: bool = False
    generated: int = 0
    sampling: Any = None  # messages.SamplingParams; None: greedy

    @property
    def kv_tokens(self) -> int:
        return self.kv.length
