"""`Tombstones`: the removes the master remembers by key, and the horizon behind which it forgot
them (issue 29; the whole rule in `kvpool.master.state`).

A remove of `key` at generation T leaves `key -> T` (`remember`), whether the key was found or
not: a node the master did not know held a copy (dropped while paused, or not yet re-reported
after a failover) may report it later, and a copy written by put P <= T (or of unknown put, 0) is
then refused (`refused`), so the remove never comes undone. Tombstones are kept
`memory_s`, then forgotten (`expire`), raising `horizon`: every tombstone <= horizon has been
forgotten. A node reporting with mark M < horizon cannot be checked for its copies of puts <=
horizon, so those are refused too. In cluster mode a remove is written to etcd before it is
applied (`recording`, `kvpool.cluster.removals`), and the forgotten ones are compacted there
(`unsaved` / `saved`).

Invariants (the caller holds the master's lock): a key's tombstone only grows; `horizon` only
grows, and `saved <= horizon`; no mark is granted at or above a generation still being recorded
(`bound`).
"""

from __future__ import annotations

import collections
from typing import Iterable


class Tombstones:
    def __init__(self, memory_s: float):
        self.memory_s = memory_s  # how long an acknowledged remove is remembered by key
        self._removed: dict[str, int] = {}  # key -> generation of its last remove
        self._order: collections.deque[tuple[float, str, int]] = collections.deque()  # (until, key, T)
        self.horizon = 0  # every tombstone at or below this generation has been forgotten
        self.saved = 0  # ... and etcd knows it (cluster mode)
        # generations of removes being written to etcd: no mark reaches them meanwhile (`bound`)
        self.recording: set[int] = set()

    def __len__(self) -> int:
        return len(self._removed)

    def get(self, key: str, default: int = 0) -> int:
        """The generation of `key`'s last remembered remove (`default`: none)."""
        return self._removed.get(key, default)

    def remember(self, key: str, generation: int, now: float) -> None:
        """A tombstone: copies of `key` written by puts up to `generation` are removed."""
        if generation > self._removed.get(key, 0):
            self._removed[key] = generation
            self._order.append((now + self.memory_s, key, generation))

    def refused(self, key: str, put_id: int, mark: int) -> bool:
        """Must a node with `mark` drop its copy of `key` written by `put_id` (0: unknown), one its
        master does not know? Yes when a kept tombstone covers it, or when a forgotten one might
        (the node's mark is below the horizon and so is the put)."""
        removed = self._removed.get(key, 0)
        if removed and (put_id == 0 or put_id <= removed):
            return True
        return mark < self.horizon and put_id <= self.horizon

    def expire(self, now: float) -> None:
        """Forget tombstones older than `memory_s`, raising the horizon past them."""
        order = self._order
        while order and order[0][0] <= now:
            _, key, generation = order.popleft()
            if self._removed.get(key) == generation:
                del self._removed[key]
            if generation > self.horizon:
                self.horizon = generation

    # -- cluster mode: etcd --------------------------------------------------------------------
    def restore(self, removed: Iterable[tuple[str, int]], horizon: int, now: float) -> None:
        """A new leader takes the (key, generation) tombstones earlier leaders left in etcd, and
        their horizon (forgotten there already)."""
        for key, generation in removed:
            if generation > horizon:
                self.remember(key, generation, now)
        self.horizon = self.saved = horizon

    def bound(self, last: int) -> int:
        """The newest generation (<= `last`, the newest issued) whose removes are all applied
        as far as etcd is concerned."""
        return min(last, min(self.recording) - 1) if self.recording else last

    def unsaved(self) -> int:
        """A horizon etcd has yet to be told (0: none)."""
        return self.horizon if self.horizon > self.saved else 0

    def mark_saved(self, horizon: int) -> None:
        self.saved = max(self.saved, horizon)

    def clear(self) -> None:
        self._removed.clear()
        self._order.clear()
        self.horizon = self.saved = 0
        self.recording.clear()
