"""A worker's own prefix cache in front of the pool: its "HBM" tier (process memory here).

Full chunks of KV, keyed by chunk key (32 hex characters), each a tensor
`[layers, 2, kv_heads, chunk_tokens, head_dim]`. Like vLLM's GPU prefix cache it publishes KV
events (`stored` when a key enters, `removed` when it leaves) so a router can tell which worker
already holds which prefix.

Invariants:
- Only full chunks are held; a tensor is never written after insertion, so readers share it
  without copying (they build their own cache from it with `torch.cat`).
- `nbytes <= capacity_bytes` after every call; eviction is least-recently-used. A hit on a run
  refreshes it back to front, so the end of a prefix chain is evicted before its beginning (a
  chain with a hole in the middle is useless past the hole).
- Every key that enters is reported in one `stored` event and every key that leaves in one
  `removed` event, in the order it happened (`events.EventLog` numbers and keeps them).
- Thread-safe: one lock guards the table; listeners run outside it, in the changing thread.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheEvent:
    kind: str  # "stored" | "removed"
    keys: tuple[str, ...]


class LocalPrefixCache:
    def __init__(self, capacity_bytes: int):
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.capacity_bytes = int(capacity_bytes)
        self._entries: collections.OrderedDict[str, Any] = collections.OrderedDict()  # oldest first
        self.nbytes = 0  # held, and their tokens: read by anyone, written under the lock
        self.tokens = 0
        self._lock = threading.Lock()
        self._listeners: list[Callable[[CacheEvent], None]] = []
        self.hits = 0  # chunks served
        self.evictions = 0

    # -- queries -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def match(self, keys: Sequence[str]) -> int:
        """Length of the longest run keys[0..n) held here (does not refresh)."""
        with self._lock:
            return sum(1 for _ in itertools.takewhile(self._entries.__contains__, keys))

    def get_run(self, keys: Sequence[str]) -> list[Any]:
        """Tensors of the longest held run keys[0..n), refreshed as most recently used."""
        with self._lock:
            run = list(itertools.takewhile(lambda tensor: tensor is not None, map(self._entries.get, keys)))
            for key in reversed(keys[: len(run)]):
                self._entries.move_to_end(key)
            self.hits += len(run)
            return run

    # -- updates -------------------------------------------------------------------------------
    def put_many(self, items: Iterable[tuple[str, Any]]) -> int:
        """Insert chunks (key, tensor) in chain order; returns how many were new.

        A chunk larger than the whole capacity is not admitted (capacity 0 disables the cache).
        """
        changes: list[tuple[str, str]] = []  # (kind, key) in the order they happen
        stored = 0
        with self._lock:
            for key, tensor in items:
                if key in self._entries:
                    continue
                size = _nbytes(tensor)
                if size > self.capacity_bytes:
                    continue
                while self.nbytes + size > self.capacity_bytes:
                    old_key, old = self._entries.popitem(last=False)
                    self._account(old, -1)
                    changes.append(("removed", old_key))
                    self.evictions += 1
                self._entries[key] = tensor
                self._account(tensor, +1)
                changes.append(("stored", key))
                stored += 1
        self._notify(changes)
        return stored

    def remove(self, keys: Iterable[str]) -> int:
        removed = []
        with self._lock:
            for key in keys:
                tensor = self._entries.pop(key, None)
                if tensor is not None:
                    self._account(tensor, -1)
                    removed.append(key)
        self._notify([("removed", key) for key in removed])
        return len(removed)

    def clear(self) -> int:
        with self._lock:
            keys = list(self._entries)
        return self.remove(keys)

    # -- events --------------------------------------------------------------------------------
    def add_listener(self, callback: Callable[[CacheEvent], None]) -> None:
        self._listeners.append(callback)

    # -- internals -----------------------------------------------------------------------------
    def _account(self, tensor: Any, sign: int) -> None:
        self.nbytes += sign * _nbytes(tensor)
        self.tokens += sign * int(tensor.shape[3])

    def _notify(self, changes: list[tuple[str, str]]) -> None:
        """One event per run of same-kind changes, in the order they happened."""
        for kind, run in itertools.groupby(changes, key=lambda change: change[0]):
            event = CacheEvent(kind, tuple(key for _, key in run))
            for callback in self._listeners:
                try:
                    callback(event)
                except Exception:  # a faulty listener must not break the serving path
                    log.exception("KV event listener failed")


def _nbytes(tensor: Any) -> int:
    return int(tensor.numel() * tensor.element_size())
