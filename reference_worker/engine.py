"""The engine thread: asks the scheduler for a step, runs it as one forward, hands out results.

    loop: schedule (under the lock) -> ModelRunner.step (outside it) -> pick tokens, emit, resolve

Submission (`submit_prefill`, `submit_decode`) and the load report are safe from any thread.
Each token is picked by `sampling.pick` (argmax, or the request's seeded draw for that position).

Invariants:
- Only the engine thread touches a submitted job's or sequence's KV.
- Every submitted prefill job's future is resolved exactly once (result or exception), and every
  submitted sequence gets exactly one final emit (finish reason or error), including on stop();
  a sequence cancelled by its client leaves at the next step without one.
- A step that fails (the forward raised) fails every job and sequence in it: they shared one
  forward, so none of their caches can be trusted past it. Nothing else is touched.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from kvpool.errors import Unavailable
from kvpool.router.cost import DecodeLine

from reference_worker import sampling
from reference_worker.model_runner import ModelRunner
from reference_worker.scheduler import Scheduler, Step
from reference_worker.sequence import DecodeSequence, PrefillJob

log = logging.getLogger(__name__)

# on_step(decode sequences, prefill tokens, seconds) after every forward
OnStep = Callable[[int, int, float], None]


class Engine:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, on_step: OnStep | None = None):
        self.runner = runner
        self.scheduler = scheduler
        self._on_step = on_step
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.decode_cost = DecodeLine()  # what a decode step costs by batch size (the load report's)

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> "Engine":
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
            self.scheduler.prefills.append(job)
            self._cond.notify()
        return job

    def submit_decode(self, seq: DecodeSequence) -> DecodeSequence:
        with self._cond:
            if self._stopping:
                raise Unavailable("worker is stopping")
            self.scheduler.joining.append(seq)
            self._cond.notify()
        return seq

    def wake(self) -> None:
        """Nudge the loop (e.g. after a cancellation) so it notices promptly."""
        with self._cond:
            self._cond.notify()

    # -- load report (read without the lock: copies of lists, good enough for a report) --------
    @property
    def queue_length(self) -> int:
        return len(self.scheduler.prefills) + len(self.scheduler.joining)

    @property
    def active_sequences(self) -> int:
        return len(self.scheduler.running)

    def kv_tokens(self) -> int:
        running, prefills = list(self.scheduler.running), list(self.scheduler.prefills)
        return sum(s.kv_tokens for s in running) + sum(len(j.token_ids) for j in prefills)

    def prefill_tokens(self) -> int:
        """Prompt tokens submitted and not yet computed."""
        return sum(j.remaining for j in list(self.scheduler.prefills))

    @property
    def busy(self) -> bool:
        """Work queued or running. A drain polls it until it stays False."""
        return self.scheduler.has_work

    # -- the engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stopping and not self.scheduler.has_work:
                        self._cond.wait()
                    if self._stopping:
                        break
                    step = self.scheduler.schedule()
                if step:
                    self._run(step)
        except BaseException:  # the engine thread must never die silently
            log.exception("engine loop crashed")
            raise
        finally:
            self._fail_all(Unavailable("worker is stopping"))

    def _run(self, step: Step) -> None:
        work = [(s.kv, [s.next_token]) for s in step.decodes]
        work += [(job.kv, job.token_ids[job.cursor:job.cursor + n]) for job, n in step.prefills]
        started = time.perf_counter()
        try:
            logits = self.runner.step(work)
        except Exception as exc:
            log.exception("a step of %d sequences and %d prefills failed", len(step.decodes), len(step.prefills))
            self._fail_step(step, exc)
            return
        elapsed = time.perf_counter() - started
        self._decoded(step.decodes, logits)
        self._prefilled(step, logits[len(step.decodes):], elapsed)
        if step.decodes and not step.prefills:
            self.decode_cost.observe(len(step.decodes), elapsed)
        if self._on_step is not None:
            self._on_step(len(step.decodes), step.tokens - len(step.decodes), elapsed)

    def _decoded(self, seqs: list[DecodeSequence], logits) -> None:
        finals: list[tuple[DecodeSequence, int | None, str | None, BaseException | None]] = []
        for seq, row in zip(seqs, logits):
            try:
                token = sampling.pick(row, seq.sampling, seq.generated + 1)  # its position in the request
            except Exception as exc:
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
            else:
                finals.append((seq, token, reason, None))
        with self._cond:  # before the final emits: a client that saw "done" sees the load without it
            for seq, *_ in finals:
                self.scheduler.finish_decode(seq)
        for seq, token, reason, error in finals:
            seq.finished = True
            seq.emit(token, reason, error)

    def _prefilled(self, step: Step, logits, elapsed: float) -> None:
        tokens = max(step.tokens, 1)
        for (job, n), row in zip(step.prefills, logits):
            job.compute_s += elapsed * n / tokens
            if job.remaining:
                continue
            job.logits = row
            with self._cond:
                self.scheduler.finish_prefill(job)
            try:
                job.future.set_result(sampling.pick(row, job.sampling, 0))
            except Exception as exc:  # the future is resolved whatever happens
                job.future.set_exception(exc)

    def _fail_step(self, step: Step, exc: BaseException) -> None:
        with self._cond:
            for seq in step.decodes:
                self.scheduler.finish_decode(seq)
            for job, _ in step.prefills:
                self.scheduler.finish_prefill(job)
        for seq in step.decodes:
            seq.finished = True
            seq.emit(None, None, exc)
        for job, _ in step.prefills:
            job.future.set_exception(exc)

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            self._stopping = True
            jobs, seqs = self.scheduler.take_all()
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(exc)
        for seq in seqs:
            if not seq.finished:
                seq.finished = True
                seq.emit(None, None, exc)

