"""How much of a prompt the pool holds: the router's one `match_prefix` per request.

The asyncio client runs every call on a thread: a hand-off there and back, two thread wake-ups
per request. Measured on the 2-core VM (pool in another process, 30 keys, interleaved): the
hand-off made a match cost ~0.37 ms of CPU against ~0.07 ms for the same call made inline, and
on a busy machine each wake-up can wait a scheduler slice. A match is one small round trip
(~0.1-0.2 ms on one host), cheaper than the hand-off, so it is asked inline, from the event
loop, on a synchronous client whose timeout is `inline_timeout_s`.

Invariants:
- the answer is the pool's answer either way: a call that fails or times out inline is asked
  again through the asyncio client (as before this module), so routing decisions do not
  depend on which path answered;
- a call blocks the event loop for at most about 3 x `inline_timeout_s` (the client's own
  retry of a lost connection); a failed call, or inline calls slow on average (a moving average
  over ~10 calls, each counted at most 4 x `slow_s`, above `slow_s`: a pool on another host, or
  an overloaded one; one scheduling hiccup on a busy machine is not enough), send the calls of
  the next `cooldown_s` through the asyncio client;
- only a static `HOST:PORT` pool is asked inline: finding the master through etcd is not
  bounded by a socket timeout;
- the inline client is a fast path, never a condition for starting: its hello has the same short
  timeout as its calls, so on a loaded machine it is tried again for up to `connect_s`, and if it
  never connects the router starts with every call on the asyncio client (a hello that took 50+
  ms under load once stopped `kvpool up` here).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, Sequence

from kvpool.errors import KVPoolError

log = logging.getLogger(__name__)


class PrefixMatcher:
    def __init__(self, address: str, *, inline: bool = True, inline_timeout_s: float = 0.05,
                 slow_s: float = 0.005, cooldown_s: float = 5.0, connect_s: float = 5.0, credential: Any = None):
        """`credential`: who to ask as (default: the client's, `KVPOOL_PRINCIPAL` of the keyring)."""
        self.address = address
        self.credential = credential
        self.inline = inline and not address.startswith(("etcd://", "etcds://", "http://", "https://"))
        self.inline_timeout_s = inline_timeout_s
        self.slow_s = slow_s
        self.cooldown_s = cooldown_s
        self.connect_s = connect_s
        self.pool: Any = None  # the AsyncClient (fallback, and the answer when inline is off)
        self._sync: Any = None
        self._inline_after = 0.0  # monotonic time before which calls go through `pool`
        self._mean_s = 0.0  # moving average of inline call times
        self.inline_calls = 0
        self.async_calls = 0

    async def connect(self) -> "PrefixMatcher":
        from kvpool.client import connect, connect_async

        self.pool = await connect_async(self.address, credential=self.credential)
        if self.inline:
            self._sync = await asyncio.to_thread(self._connect_inline, connect)
        return self

    def _connect_inline(self, connect) -> Any:
        deadline = time.monotonic() + self.connect_s
        while True:
            try:
                return connect(self.address, timeout=self.inline_timeout_s, credential=self.credential)
            except KVPoolError as exc:
                if time.monotonic() >= deadline:
                    log.warning("match_prefix inline client did not connect within %.0f s (%s): every call "
                                "goes through the asyncio client", self.connect_s, exc)
                    return None
                time.sleep(self.inline_timeout_s)

    async def match(self, keys: Sequence[str]) -> int:
        """n such that keys[0..n) are all in the pool; raises `KVPoolError` as the client does."""
        sync = self._sync
        if sync is not None and time.monotonic() >= self._inline_after:
            started = time.monotonic()
            try:
                n = sync.match_prefix(keys)
            except KVPoolError as exc:
                self._cool(f"failed inline ({exc})")
            else:
                self.inline_calls += 1
                took = min(time.monotonic() - started, 4 * self.slow_s)
                self._mean_s += 0.1 * (took - self._mean_s)
                if self._mean_s > self.slow_s:
                    self._cool(f"took {self._mean_s * 1e3:.1f} ms inline on average")
                return n
        self.async_calls += 1
        return await self.pool.match_prefix(keys)

    def _cool(self, why: str) -> None:
        self._inline_after = time.monotonic() + self.cooldown_s
        self._mean_s = 0.0
        log.info("match_prefix %s: the next %.0f s go through the asyncio client", why, self.cooldown_s)

    async def close(self) -> None:
        if self._sync is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self._sync.close)
        if self.pool is not None:
            with contextlib.suppress(Exception):
                await self.pool.close()
