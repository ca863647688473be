"""The discrete-event simulation of a cluster: P prefill + D decode instances (or K colocated),
the pool, and the real router policy between them.

A request's life (times in simulated seconds, as the real router and workers do it):
  arrival    -> the router matches the prompt's blocks against the pool (global cache) or every
                instance's own cache (local caches), builds a `Snapshot` of the instances and
                asks the real policy (`kvpool.router.policy`) for a `Decision`
  prefill    -> after one control hop (`rpc_s`) and the fetch of the cached blocks, the prompt
                joins the chosen instance's prefill queue; once computed, the new blocks are
                pushed to the pool (on the TTFT path when disaggregated, behind it otherwise)
                and become visible to later requests only then
  first token-> end of prefill (+ push) + one hop
  decode     -> disaggregated: the decode instance pulls the prompt's KV and joins its batch
                (the step it joins also assembles that KV: `Profile.join_s`); otherwise the
                sequence joins the batch of the instance that prefilled it
The router's cost model is the real `CostModel`, fed the simulated timings as the real workers
feed it theirs, so policies decide on fitted estimates, not on the profile itself.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from kvpool.errors import InvalidArgument
from kvpool.router.cost import CostModel
from kvpool.router.policy import RouteRequest, Snapshot, Targets, make_policy
from kvpool.tools.sim.instance import Instance, PrefillJob, Sequence
from kvpool.tools.sim.pool import SimPool
from kvpool.tools.sim.profile import Profile
from kvpool.tools.sim.workload import SimRequest, Workload

COST_REFRESH = 32  # routing decisions between reads of the fitted cost model (the router polls too)


@dataclass
class SimConfig:
    prefill: int = 0
    decode: int = 0
    colocated: int = 0
    profile: Profile = field(default_factory=lambda: Profile("default"))
    decode_profile: Profile | None = None  # decode instances on other cards (Splitwise)
    dram_bytes: int | None = None  # pool DRAM in total; None: unlimited
    ssd_bytes: int = 0
    eviction: str = "lru"
    policy: str = "cache_aware"
    cache: str = "global"  # global: one pool shared by all | local: each prefilling instance its own
    local_prefill_tokens: int = 256  # the router's default (conditional disaggregation)
    admission: Targets | None = None  # the router's admission targets (None: admit everything)
    fit_cost: bool = True  # feed the router's cost model online (False: the profile's values only)
    host_cores: int = 0  # >0: all instances share this many cores (one host, like the reference workers here)

    def validate(self) -> None:
        if self.colocated and (self.prefill or self.decode):
            raise InvalidArgument("give either --colocated K or --prefill N --decode M, not both")
        if not self.colocated and (self.decode <= 0):
            raise InvalidArgument("need at least one decode instance (--decode M) or --colocated K")
        if self.cache not in ("global", "local"):
            raise InvalidArgument(f"cache must be global or local, got {self.cache!r}")
        if self.dram_bytes is not None and self.dram_bytes < 0 or self.ssd_bytes < 0:
            raise InvalidArgument("capacities must not be negative")

    @property
    def instances(self) -> int:
        return self.colocated or self.prefill + self.decode


class Flight:
    """One request in the simulation and what happened to it."""

    __slots__ = ("req", "kind", "hit_blocks", "cached_tokens", "t_first", "t_done", "decode_inst", "computed")

    def __init__(self, req: SimRequest):
        self.req = req
        self.kind = ""
        self.hit_blocks = 0
        self.cached_tokens = 0
        self.computed = 0
        self.t_first = -1.0
        self.t_done = -1.0
        self.decode_inst: Instance | None = None


class Simulation:
    def __init__(self, workload: Workload, config: SimConfig):
        config.validate()
        self.workload = workload
        self.config = config
        self.policy = make_policy(config.policy)
        prof_p = config.profile
        prof_d = config.decode_profile or prof_p
        self.block_tokens = workload.block_tokens
        self.block_bytes = workload.block_tokens * prof_p.bytes_per_token
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._seq = 0
        self.cost = CostModel(prof_p.cost_params())
        self._cost_params = self.cost.params()
        self.targets = config.admission or Targets(local_prefill_tokens=config.local_prefill_tokens)
        dram = None if config.dram_bytes is None else config.dram_bytes // self.block_bytes
        ssd = config.ssd_bytes // self.block_bytes if config.ssd_bytes else None
        specs = ([("both", prof_p)] * config.colocated if config.colocated else
                 [("prefill", prof_p)] * config.prefill + [("decode", prof_d)] * config.decode)
        cachers = sum(1 for role, _ in specs if role != "decode") if config.cache == "local" else 0
        self.pool = None if config.cache == "local" else SimPool(dram, ssd, self.block_bytes, config.eviction)
        self.instances: list[Instance] = []
        for i, (role, prof) in enumerate(specs):
            cache = None
            if cachers and role != "decode":
                cache = SimPool(None if dram is None else dram // cachers, None if ssd is None else ssd // cachers,
                                self.block_bytes, config.eviction)
            self.instances.append(Instance(self, f"{role}-{i}", role, prof, cache))
        self._by_name = {inst.name: inst for inst in self.instances}
        self._cachers = [inst for inst in self.instances if inst.cache is not None]
        self.flights: list[Flight] = []
        self.tbt_values: list[float] = []
        self.tbt_weights: list[int] = []
        self.routed = 0
        self.wall_s = 0.0
        self.busy_instances = 0

    # -- event queue ---------------------------------------------------------------------------------
    def at(self, t: float, fn: Callable[[Any], None], arg: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, arg))

    def run(self, on_progress: Callable[[int], None] | None = None) -> "Simulation":
        started = time.perf_counter()
        for req in self.workload.requests:
            self.at(req.arrival_s, self._arrive, req)
        heap, pop = self._heap, heapq.heappop
        done = 0
        while heap:
            t, _, fn, arg = pop(heap)
            self.now = t
            fn(arg)
            if on_progress is not None and fn == self._arrive:
                done += 1
                if done % 500 == 0:
                    on_progress(500)
        if on_progress is not None:
            on_progress(done % 500)
        self.wall_s = time.perf_counter() - started
        return self

    # -- routing -------------------------------------------------------------------------------------
    def _arrive(self, req: SimRequest) -> None:
        flight = Flight(req)
        self.flights.append(flight)
        pool_chunks = self.pool.match(req.blocks) if self.pool is not None else 0
        local = {inst.name: inst.cache.match(req.blocks) for inst in self._cachers}
        views = tuple(inst.view(local.get(inst.name, 0)) for inst in self.instances)
        self.routed += 1
        if self.config.fit_cost and self.routed % COST_REFRESH == 0:
            self._cost_params = self.cost.params()
        rr = RouteRequest(seq=self.routed, prompt_tokens=req.prompt_tokens, max_tokens=req.output_tokens,
                          chunk_tokens=self.block_tokens, pool_prefix_chunks=pool_chunks,
                          bytes_per_token=self.config.profile.bytes_per_token)
        decision = self.policy.choose(rr, Snapshot(views, self._cost_params, self.targets))
        flight.kind = decision.kind
        if decision.reject is not None:
            return
        dec = self._by_name[decision.decode]
        pre = self._by_name[decision.prefill] if decision.prefill is not None else dec
        flight.decode_inst = dec
        prof = pre.profile
        # what the prefilling instance reuses: its own cache (local mode) or the pool
        if pre.cache is not None:
            hit = local[pre.name]
            pre.cache.read(req.blocks, hit)
            fetch = 0.0
        elif self.pool is not None and pool_chunks:
            hit = pool_chunks
            from_dram, from_ssd = self.pool.read(req.blocks, hit)
            fetch = prof.fetch_s(from_dram * self.block_bytes, from_ssd * self.block_bytes)
        else:
            hit, fetch = 0, 0.0
        flight.hit_blocks = hit
        flight.cached_tokens = min(hit * self.block_tokens, req.prompt_tokens - 1)
        flight.computed = req.prompt_tokens - flight.cached_tokens
        pre.pending_tokens += flight.computed
        dec.inbound += 1  # counted as the router counts its in-flight decodes: from dispatch on
        self.at(self.now + prof.rpc_s + fetch, self._enqueue, (pre, PrefillJob(flight, flight.computed,
                                                                              flight.cached_tokens), fetch))

    def _enqueue(self, arg: tuple[Instance, PrefillJob, float]) -> None:
        inst, job, _ = arg
        inst.submit_prefill(job, self.now)

    # -- callbacks from instances --------------------------------------------------------------------
    def slowdown(self, was_busy: bool, inst: Instance | None = None) -> float:
        """Time factor for an iteration starting now (an idle instance becoming busy counts itself)."""
        cores = self.config.host_cores
        if not was_busy:
            self.busy_instances += 1
            self.busy_changed(inst)
        return max(1.0, self.busy_instances / cores) if cores > 0 else 1.0

    def busy_changed(self, inst: Instance | None) -> None:
        """On a shared host, the other instances' decode stretches end at their next step, so their
        speed follows the new number of busy instances."""
        if self.config.host_cores > 0:
            for other in self.instances:
                if other is not inst and other.wake_at is not None:
                    other.recut(self.now)

    def prefill_done(self, inst: Instance, job: PrefillJob, now: float) -> None:
        flight, req, prof = job.flight, job.flight.req, inst.profile
        dec = flight.decode_inst
        new_tokens = req.prompt_tokens - min(req.prompt_tokens, flight.hit_blocks * self.block_tokens)
        push = prof.push_s(new_tokens * prof.bytes_per_token) if self.pool is not None else 0.0
        if inst.cache is not None:
            inst.cache.store(req.blocks)
        elif self.pool is not None:
            self.at(now + push, self._store, req.blocks)
        if self.config.fit_cost:  # the router learns from every prefill it is told about
            self.cost.observe_prefill(job.done_tokens, job.cached, prof.prefill_s(job.done_tokens, job.cached))
        if dec is inst:  # colocated, or a local prefill on the decode instance
            flight.t_first = now + prof.rpc_s
            self._start_decode(flight, inst, now)
            return
        flight.t_first = now + push + prof.rpc_s
        if self.config.fit_cost:
            self.cost.observe_handoff(push + prof.rpc_s)
        pull = dec.profile.pull_s(req.prompt_tokens * dec.profile.bytes_per_token)
        self.at(flight.t_first + dec.profile.rpc_s + pull, self._join_remote, flight)

    def _join_remote(self, flight: Flight) -> None:
        self._start_decode(flight, flight.decode_inst, self.now, handed_off=True)

    def _start_decode(self, flight: Flight, inst: Instance, now: float, handed_off: bool = False) -> None:
        inst.inbound -= 1
        owed = flight.req.output_tokens - 1
        if owed <= 0:
            flight.t_done = flight.t_first
            return
        prompt = flight.req.prompt_tokens
        inst.submit_decode(Sequence(flight, owed, prompt + 1, join_kv=prompt if handed_off else 0), now)

    def _store(self, blocks: tuple[int, ...]) -> None:
        self.pool.store(blocks)

    def decode_done(self, flight: Flight, now: float) -> None:
        flight.t_done = max(now + flight.decode_inst.profile.rpc_s, flight.t_first)

    def tbt_sample(self, seconds: float, tokens: int) -> None:
        self.tbt_values.append(seconds)
        self.tbt_weights.append(tokens)
