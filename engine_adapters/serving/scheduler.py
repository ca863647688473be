"""Continuous batching with decode priority, on one engine thread.

Each iteration of the loop:
  1. admits waiting decode sequences into the running batch (up to `max_batch` sequences and
     `max_kv_tokens` tokens of KV, counting what each may still grow): requests join only
     between steps;
  2. runs one decode step for every running sequence (decode first: a token already promised
     to a streaming client is never delayed by a new prompt), dropping those that finished or
     whose client went away: requests leave only between steps;
  3. runs one prefill chunk of at most `prefill_chunk_tokens` tokens of the oldest prefill job
     (the gaps between decode steps). None means a whole prompt in one pass: the right choice
     when there is no decode to protect (a prefill-only worker), and the only one that keeps a
     prompt's logits bitwise equal to a single full pass.

Within a decode step the sequences run one after another, each as a batch-1 forward (see
`runner.py` for why: exact greedy equality with `model.generate`). The batch is still a real
continuous batch at the request level: its membership changes every iteration. Each token is
picked by `sampling.pick` (argmax, or the request's seeded draw for that position).

Invariants:
- Only the engine thread touches a submitted job's or sequence's cache.
- Every submitted prefill job's future is resolved exactly once (result or exception), and every
  submitted sequence gets exactly one final emit (finish reason or error), including on stop().
  A job whose future was cancelled before its first chunk (its caller went away) is dropped
  uncomputed: the engine marks a future running before computing, so it cannot be cancelled later.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable

from kvpool.errors import Unavailable

from engine_adapters.serving import sampling
from engine_adapters.serving.runner import ModelRunner
from engine_adapters.serving.sequence import DecodeSequence, PrefillJob

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, runner: ModelRunner, *, max_batch: int = 32, prefill_chunk_tokens: int | None = None,
                 max_kv_tokens: int | None = None,
                 on_decode_step: Callable[[int, float], None] | None = None,
                 on_prefill_chunk: Callable[[int, float], None] | None = None):
        if max_batch <= 0:
            raise ValueError("max_batch must be positive")
        if prefill_chunk_tokens is not None and prefill_chunk_tokens <= 0:
            raise ValueError("prefill_chunk_tokens must be positive or None")
        self.runner = runner
        self.max_batch = max_batch
        self.max_kv_tokens = max_kv_tokens  # admission: KV of the running batch stays under this
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self._on_decode_step = on_decode_step
        self._on_prefill_chunk = on_prefill_chunk
        self._cond = threading.Condition()
        self._prefills: collections.deque[PrefillJob] = collections.deque()
        self._joining: collections.deque[DecodeSequence] = collections.deque()
        self._running: list[DecodeSequence] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.steps = 0

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> "Scheduler":
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        self._fail_all(Unavailable("worker is stopping"))  # work that never reached the loop

    # -- submission (any thread) ---------------------------------------------------------------
    def submit_prefill(self, job: PrefillJob) -> PrefillJob:
        with self._cond:
            if self._stopping:
                raise Unavailable("worker is stopping")
            self._prefills.append(job)
            self._cond.notify()
        return job

    def submit_decode(self, seq: DecodeSequence) -> DecodeSequence:
        with self._cond:
            if self._stopping:
                raise Unavailable("worker is stopping")
            self._joining.append(seq)
            self._cond.notify()
        return seq

    def wake(self) -> None:
        """Nudge the loop (e.g. after a cancellation) so it notices promptly."""
        with self._cond:
            self._cond.notify()

    # -- load report ---------------------------------------------------------------------------
    @property
    def queue_length(self) -> int:
        return len(self._prefills) + len(self._joining)

    @property
    def active_sequences(self) -> int:
        return len(self._running)

    def kv_tokens(self) -> int:
        running = list(self._running)
        prefills = list(self._prefills)
        return sum(s.kv_tokens for s in running) + sum(len(j.token_ids) for j in prefills)

    def prefill_tokens(self) -> int:
        """Prompt tokens submitted and not yet computed (the job at the head counts what it has left)."""
        return sum(j.remaining for j in list(self._prefills))

    @property
    def busy(self) -> bool:
        """Work queued or running. Read without the lock: a drain polls it until it stays False."""
        return bool(self._prefills or self._joining or self._running)

    # -- the engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stopping and not (self._prefills or self._joining or self._running):
                        self._cond.wait()
                    if self._stopping:
                        break
                    self._admit()
                    job = self._prefills[0] if self._prefills else None
                if self._running:
                    self._decode_step()
                if job is not None:
                    self._prefill_chunk(job)
        except BaseException:  # the engine thread must never die silently
            log.exception("engine loop crashed")
            raise
        finally:
            self._fail_all(Unavailable("worker is stopping"))

    def _admit(self) -> None:
        """Move waiting sequences into the batch, oldest first, while batch size and KV budget allow
        (a sequence alone in the batch is always admitted, so a long one cannot starve)."""
        held = sum(s.kv_tokens + s.remaining for s in self._running) if self.max_kv_tokens else 0
        while self._joining and len(self._running) < self.max_batch:
            nxt = self._joining[0]
            if self.max_kv_tokens and self._running and held + nxt.kv_tokens + nxt.remaining > self.max_kv_tokens:
                break
            self._running.append(self._joining.popleft())
            held += nxt.kv_tokens + nxt.remaining

    def _decode_step(self) -> None:
        started = time.perf_counter()
        still: list[DecodeSequence] = []
        finals: list[tuple[DecodeSequence, int | None, str | None, BaseException | None]] = []
        stepped = 0
        for seq in self._running:
            if seq.cancelled:
                seq.finished = True
                continue
            stepped += 1
            try:
                token = sampling.pick(self.runner.extend(seq.cache, [seq.next_token]), seq.sampling, seq.next_index)
            except Exception as exc:
                log.exception("decode step failed for request %s", seq.request_id)
                finals.append((seq, None, None, exc))
                continue
            seq.generated += 1
            seq.remaining -= 1
            seq.next_token = token
            reason = "stop" if token in seq.stop_ids else ("length" if seq.remaining <= 0 else None)
            if reason is None and seq.kv_tokens + 1 >= self.runner.max_positions:
                reason = "length"
            if reason is None:
                seq.emit(token, None, None)
                still.append(seq)
            else:
                finals.append((seq, token, reason, None))
        self._running = still  # before the final emits, so a client that saw "done" sees the load without it
        for seq, token, reason, error in finals:
            seq.finished = True
            seq.emit(token, reason, error)
        self.steps += 1
        if self._on_decode_step is not None and stepped:  # a step of cancelled sequences ran no forward
            self._on_decode_step(stepped, time.perf_counter() - started)

    def _prefill_chunk(self, job: PrefillJob) -> None:
        """One chunk of `job`; a finished or failed job leaves the queue before it is resolved."""
        if not job.future.running() and not job.future.set_running_or_notify_cancel():
            self._pop(job)  # its caller went away (the awaiting task was cancelled): nothing to compute
            return
        started = time.perf_counter()
        budget = self.prefill_chunk_tokens or job.remaining
        end = min(len(job.token_ids), job.cursor + budget)
        try:
            job.logits = self.runner.extend(job.cache, job.token_ids[job.cursor:end])
        except Exception as exc:
            log.exception("prefill failed for request %s", job.request_id)
            self._pop(job)
            job.future.set_exception(exc)
            return
        elapsed = time.perf_counter() - started
        job.compute_s += elapsed
        tokens = end - job.cursor
        job.cursor = end
        if self._on_prefill_chunk is not None:
            self._on_prefill_chunk(tokens, elapsed)
        if job.cursor == len(job.token_ids):
            self._pop(job)
            try:
                first = sampling.pick(job.logits, job.sampling, 0)
            except Exception as exc:  # the future is resolved whatever happens
                job.future.set_exception(exc)
                return
            job.future.set_result(first)

    def _pop(self, job: PrefillJob) -> None:
        with self._cond:
            if self._prefills and self._prefills[0] is job:
                self._prefills.popleft()

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            self._stopping = True
            prefills, self._prefills = list(self._prefills), collections.deque()
            seqs = list(self._joining) + list(self._running)
            self._joining.clear()
            self._running = []
        for job in prefills:
            if not job.future.done():
                job.future.set_exception(exc)
        for seq in seqs:
            if not seq.finished:
                seq.finished = True
                seq.emit(None, None, exc)
