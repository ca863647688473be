"""The KV event log a worker publishes (`GET /v1/events?since=N`), as vLLM publishes its GPU
prefix cache's events: what entered (`stored`) and left (`removed`) this worker's local prefix
cache (tier "local"), and which chunks this worker wrote to or dropped from the pool (tier
"pool"). A router follows it to learn which worker already holds which prefix.

Invariants: sequence numbers start at 1 and strictly increase; the log keeps the newest
`capacity` events; a reader whose `since` is older than the oldest kept event is told
(`dropped=True`) and should resynchronize from the worker's full state instead.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Iterable

from kvpool.worker_api import EventsResponse, KVEventMsg


class EventLog:
    def __init__(self, capacity: int = 4096):
        self._events: collections.deque[KVEventMsg] = collections.deque(maxlen=capacity)
        self._seq = 0
        self._lock = threading.Lock()

    def append(self, kind: str, keys: Iterable[str], tier: str) -> None:
        with self._lock:
            self._seq += 1
            self._events.append(KVEventMsg(seq=self._seq, kind=kind, keys=list(keys), tier=tier, ts=time.time()))

    def since(self, seq: int, limit: int = 1000) -> EventsResponse:
        with self._lock:
            events = [e for e in self._events if e.seq > seq][:limit]
            oldest = self._events[0].seq if self._events else self._seq + 1
            dropped = seq < self._seq and seq + 1 < oldest
            nxt = events[-1].seq if events else self._seq
        return EventsResponse(events=events, next=nxt, dropped=dropped)
