"""One simulated serving instance: the reference worker's scheduler as a discrete-event model.

Like `reference_worker/scheduler.py`, each iteration admits waiting decode sequences
(up to `max_batch` sequences and `max_kv_tokens` of KV), runs one decode step of the running
batch, then one prefill chunk of the oldest prefill job (the whole prompt on a prefill-only
instance). Iterations that carry a prefill chunk are one event each. Iterations that only decode
are not: while the batch does not change, the next `K` steps (K = the fewest tokens any running
sequence still owes) are one event whose time is `Profile.decode_steps_s` in closed form; a
sequence or prompt that arrives meanwhile cuts that plan at the next step boundary. So the event
count grows with requests and prefill chunks, never with generated tokens. The first step of a
batch that admitted handed-off sequences is one event of its own: it is longer by
`Profile.join_s` of their KV (the reference worker assembles their pool chunks in that step).

On a host whose instances share `host_cores` CPU cores (the reference workers here), an
iteration that starts while more instances are busy than there are cores runs proportionally
slower (processor sharing, fixed at the iteration's start).

Invariants: `pending_tokens` = prompt tokens routed here and not yet computed (what the router's
`queue_tokens` reads); `inbound` = sequences routed here for decode that have not joined yet;
at most one boundary event per instance is live (older ones carry a stale `version`).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from kvpool.router.cost import DecodeLine
from kvpool.router.policy import WorkerView
from kvpool.tools.sim.profile import Profile

if TYPE_CHECKING:
    from kvpool.tools.sim.engine import Simulation, Flight


class PrefillJob:
    __slots__ = ("flight", "remaining", "done_tokens", "cached")

    def __init__(self, flight: "Flight", computed: int, cached: int):
        self.flight = flight
        self.remaining = computed
        self.done_tokens = 0
        self.cached = cached


class Sequence:
    __slots__ = ("flight", "remaining", "kv", "join_kv")

    def __init__(self, flight: "Flight", remaining: int, kv: int, join_kv: int = 0):
        self.flight = flight
        self.remaining = remaining  # decode steps still owed
        self.kv = kv
        self.join_kv = join_kv  # handed off: KV tokens its first step assembles (0: computed here)


class Instance:
    def __init__(self, sim: "Simulation", name: str, role: str, profile: Profile, cache: Any = None):
        self.sim = sim
        self.name = name
        self.role = role
        self.profile = profile
        self.chunk = None if role == "prefill" else profile.prefill_chunk_tokens
        self.cache = cache  # a per-instance SimPool in local-cache mode, else None
        self.queue: deque[PrefillJob] = deque()
        self.pending_tokens = 0
        self.running: list[Sequence] = []
        self.joining: deque[Sequence] = deque()
        self.inbound = 0
        self.kv = 0
        self.busy_s = 0.0
        self.version = 0
        self.wake_at: float | None = None
        self._step: tuple[Any, ...] | None = None  # what the iteration in progress does
        self.prefill_s = 0.0  # of busy_s: prefill chunks
        self.join_s = 0.0  # of busy_s: assembling handed-off sequences' KV
        self.steps = 0
        self.decode_line = DecodeLine()  # as a reference worker fits its decode steps

    # -- what the router sees ------------------------------------------------------------------------
    def view(self, local_chunks: int = 0) -> WorkerView:
        held = len(self.cache.dram) if self.cache is not None and self.cache.dram is not None else 0
        return WorkerView(self.name, self.role, self.pending_tokens,
                          len(self.running) + len(self.joining) + self.inbound, self.kv,
                          self.profile.max_batch, local_chunks, held)

    # -- submissions ---------------------------------------------------------------------------------
    def submit_prefill(self, job: PrefillJob, now: float) -> None:
        self.queue.append(job)
        self._nudge(now)

    def submit_decode(self, seq: Sequence, now: float) -> None:
        self.joining.append(seq)
        self._nudge(now)

    def _nudge(self, now: float) -> None:
        if self.wake_at is None:
            self._iterate(now)
        elif self._step is not None and self._step[0] == "plan":
            self._cut(now)

    def _cut(self, now: float) -> None:
        """End the decode-only plan at the first step boundary at or after `now`."""
        _, t0, batch, kv0, steps, slow, _ = self._step  # type: ignore[misc]
        elapsed = (now - t0) / slow
        done = self.profile.steps_within(batch, kv0, elapsed)
        if self.profile.decode_steps_s(batch, kv0, done) < elapsed:
            done += 1  # the step in progress completes first
        done = max(1, done)
        if done >= steps:
            return
        self._step = ("plan", t0, batch, kv0, done, slow, 0.0)
        self._schedule(t0 + slow * self.profile.decode_steps_s(batch, kv0, done))

    def recut(self, now: float) -> None:
        """Re-plan a decode stretch from its next step boundary (the host's load changed)."""
        if self._step is not None and self._step[0] == "plan":
            self._cut(now)

    def _schedule(self, t: float) -> None:
        self.version += 1
        self.wake_at = t
        self.sim.at(t, self._boundary, self.version)

    # -- the loop ------------------------------------------------------------------------------------
    def _boundary(self, version: int) -> None:
        if version != self.version:
            return
        now = self.sim.now
        step, self._step = self._step, None
        if step[0] == "plan":
            _, t0, batch, kv0, steps, _, join = step
            dt = now - t0
            self.join_s += join
            self._advance(steps, dt, batch)
            self.decode_line.observe(batch, dt / steps)
            step_s, token_s = self.decode_line.fit()
            self.sim.cost.observe_decode(token_s, step_s)
        else:
            _, t0, batch, job, chunk, join = step
            dt = now - t0
            self.join_s += join
            if batch:
                self._advance(1, dt, batch)
            job.remaining -= chunk
            job.done_tokens += chunk
            self.pending_tokens -= chunk
            self.prefill_s += dt if not batch else max(0.0, dt - join - self.profile.decode_step_s(batch, self.kv))
            if job.remaining <= 0:
                self.queue.popleft()
                self.sim.prefill_done(self, job, now)
        self.busy_s += dt
        self._iterate(now)

    def _advance(self, steps: int, dt: float, batch: int) -> None:
        """`steps` decode steps of the running batch took `dt`: tokens, TBT samples, finishes."""
        self.steps += steps
        self.sim.tbt_sample(dt / steps, batch * steps)
        self.kv += batch * steps
        still = []
        for seq in self.running:
            seq.remaining -= steps
            seq.kv += steps
            if seq.remaining <= 0:
                self.kv -= seq.kv
                self.sim.decode_done(seq.flight, self.sim.now)
            else:
                still.append(seq)
        self.running = still

    def _admit(self) -> int:
        """Admit waiting sequences; returns the KV tokens of the handed-off ones among them."""
        p = self.profile
        held = sum(s.kv + s.remaining for s in self.running) if self.joining else 0
        join_kv = 0
        while self.joining and len(self.running) < p.max_batch:
            nxt = self.joining[0]
            if self.running and held + nxt.kv + nxt.remaining > p.max_kv_tokens:
                break
            self.joining.popleft()
            self.running.append(nxt)
            self.kv += nxt.kv
            held += nxt.kv + nxt.remaining
            join_kv += nxt.join_kv
        return join_kv

    def _iterate(self, now: float) -> None:
        p = self.profile
        join = p.join_s(self._admit())
        batch = len(self.running)
        was_busy = self.wake_at is not None
        if self.queue:
            job = self.queue[0]
            chunk = job.remaining if self.chunk is None else min(job.remaining, self.chunk)
            slow = self.sim.slowdown(was_busy, self)
            dt = p.mixed_s(batch, self.kv, chunk, job.cached + job.done_tokens) + join
            self._step = ("mixed", now, batch, job, chunk, join)
            self._schedule(now + dt * slow)
        elif batch:
            slow = self.sim.slowdown(was_busy, self)
            steps = 1 if join else min(s.remaining for s in self.running)  # a join step is its own event
            self._step = ("plan", now, batch, self.kv, steps, slow, join)
            self._schedule(now + slow * (p.decode_steps_s(batch, self.kv, steps) + join))
        else:
            if was_busy:
                self.sim.busy_instances -= 1
                self._step = None
                self.wake_at = None
                self.sim.busy_changed(self)
            self._step = None
            self.wake_at = None
