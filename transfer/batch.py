"""Ops and batches: what callers submit and how completion is tracked.

An op is split into slices (at most `slice_bytes` each) that transports move independently,
possibly over different connections. Invariants of `Batch`:
- `remaining` counts slices not yet finished, plus 1 for the submitter until `_seal` (so a
  transport that finishes all its slices early cannot complete a batch another transport has
  not yet counted its slices into); it changes only under `_lock`.
- an op has failed iff some slice of it failed; its first error is kept in `failures`.
- the batch is done iff `remaining == 0`; then the internal `_hooks` run (e.g. copying a
  staged READ into its CUDA tensor), then `_done` is set, then callbacks run exactly once, all
  on the thread that finished the last slice (callbacks must be quick and must not block).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable, NamedTuple

from transfer.descriptor import SegmentDescriptor
from transfer.errors import TransferError, TransferTimeout

READ = 1
WRITE = 2


class Op(NamedTuple):
    """One transfer: READ copies remote -> local, WRITE copies local -> remote."""

    opcode: int
    local: Any  # a buffer (see transfer.buffers) or a byte memoryview
    local_offset: int
    remote: SegmentDescriptor
    remote_offset: int
    length: int
    grant: bytes | None = None  # the remote owner's grant covering this range (`transfer.grant`), if it requires one


class Batch:
    """Completion handle of a submitted list of ops: `wait()`, `poll()` or `await batch`."""

    __slots__ = ("ops", "failures", "_remaining", "_lock", "_done", "_callbacks", "_hooks", "transport")

    def __init__(self, ops: list[Op], transport: str = ""):
        self.ops = ops
        self.transport = transport
        self.failures: dict[int, BaseException] = {}
        self._remaining = 1  # the submitter's guard, dropped by _seal
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._callbacks: list[Callable[[], None]] = []
        # (op index, fn): run before the batch reports done; an exception fails that op
        self._hooks: list[tuple[int, Callable[[], None]]] = []

    # -- producer side (transports) ------------------------------------------------------
    def _expect(self, slices: int) -> None:
        """Count `slices` more pending slices; call before any of them can finish."""
        with self._lock:
            self._remaining += slices

    def _seal(self) -> None:
        """All slices have been counted: drop the submitter's guard (done now if none are left)."""
        self._slices_ok(1)

    def _slice_done(self, op_index: int, error: BaseException | None = None) -> None:
        if error is not None:
            with self._lock:
                self.failures.setdefault(op_index, error)
        self._slices_ok(1)

    def _slices_ok(self, count: int) -> None:
        """`count` slices finished, their errors already in `failures` (one lock round trip for many)."""
        with self._lock:
            self._remaining -= count
            last = self._remaining == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        for index, hook in self._hooks:
            if index in self.failures:
                continue
            try:
                hook()
            except Exception as exc:
                self.failures[index] = TransferError(f"op {index}: finishing step failed: {exc}")
        with self._lock:
            callbacks, self._callbacks = self._callbacks, []
            self._done.set()
        for cb in callbacks:
            cb()

    # -- consumer side ---------------------------------------------------------------------
    def poll(self) -> bool:
        """True once every op has finished (successfully or not)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until done; raise `TransferError` listing failed ops, or `TransferTimeout`."""
        if not self._done.wait(timeout):
            raise TransferTimeout(f"batch of {len(self.ops)} ops not done after {timeout}s")
        self._raise_if_failed()

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn()

    def __await__(self):
        if not self._done.is_set():
            loop = asyncio.get_running_loop()
            fut = loop.create_future()

            def wake() -> None:
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(None))

            self.add_done_callback(wake)
            yield from fut.__await__()
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if not self.failures:
            return
        first_index = min(self.failures)
        first = self.failures[first_index]
        cls = TransferTimeout if all(isinstance(e, TransferTimeout) for e in self.failures.values()) \
            else TransferError
        raise cls(f"{len(self.failures)} of {len(self.ops)} ops failed; op {first_index}: {first}",
                  self.failures) from first

    def __repr__(self) -> str:
        state = "done" if self.poll() else "pending"
        return f"<Batch {len(self.ops)} ops via {self.transport or '?'} {state}, {len(self.failures)} failed>"
