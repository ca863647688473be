"""Which requests a worker has accepted and not finished, and whether it still accepts any
(draining). A drain waits on these counts, so they must never miss a request nor leak one.

Invariants:
- A request that passed the draining check is counted before a drain can see zero: the check
  and the count happen under one lock, and `drain()` sets the flag under it.
- A stream counts from its acceptance (before its prefill or KV load) until its iterator is
  closed, finishes, or is dropped without ever being started, exactly once (`_StreamSlot`).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import AsyncIterator, Iterator

from kvpool.errors import Unavailable

DRAINING_MESSAGE = "this worker is draining: it finishes its open streams and takes no new requests"


class _StreamSlot:
    """One open stream. `release` is idempotent: the iterator's `finally` and the finalizer of an
    iterator that was never started (client gone before the body) may both call it."""

    def __init__(self, admission: "Admission"):
        self._admission = admission
        self._released = False

    def release(self) -> None:
        with self._admission._lock:
            if not self._released:
                self._released = True
                self._admission.open_streams -= 1


class Admission:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.draining = False
        self._requests = 0  # prefill requests in progress
        self.open_streams = 0  # decode/generate streams accepted and not yet closed (written under _lock)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._requests + self.open_streams

    def drain(self) -> None:
        """Refuse new work from now on; what was accepted runs to its end."""
        with self._lock:
            self.draining = True

    def _refuse_if_draining(self) -> None:  # with _lock held
        if self.draining:
            raise Unavailable(DRAINING_MESSAGE)

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        """Count a non-streaming request for as long as the block runs; `Unavailable` if draining."""
        with self._lock:
            self._refuse_if_draining()
            self._requests += 1
        try:
            yield
        finally:
            with self._lock:
                self._requests -= 1

    def open_stream(self) -> _StreamSlot:
        """Count a stream from now; hand the slot to `watch` once its iterator exists, or
        `release` it if opening fails. `Unavailable` if draining."""
        with self._lock:
            self._refuse_if_draining()
            self.open_streams += 1
        return _StreamSlot(self)

    def watch(self, events: AsyncIterator, slot: _StreamSlot) -> AsyncIterator:
        """`events`, releasing `slot` when the stream ends however it ends."""
        stream = _watched(events, slot)
        weakref.finalize(stream, slot.release)  # dropped before its first item: `finally` never runs
        return stream


async def _watched(events: AsyncIterator, slot: _StreamSlot) -> AsyncIterator:
    try:
        async for event in events:
            yield event
    finally:
        slot.release()  # before any await: a cancelled scope cancels every await in this block
        await events.aclose()
