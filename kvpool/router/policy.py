"""Routing policies: which worker prefills a request and which decodes it.

A policy is a pure function of a `RouteRequest` and a `Snapshot` (worker load, what each worker
already holds of this prompt, the fitted cost model, the targets). It keeps no state and does no
I/O, so the router and the simulator (`kvpool/tools/sim/`) run the very same code; what changes
between calls lives in the snapshot (round robin reads the request's arrival number).

Invariants of every `Decision`:
- `reject` is set exactly when there is no choice: `kind` "unavailable" when no worker can decode
  (the router answers 503), "rejected" when none meets the targets (429, with the best estimates
  found); then `prefill`/`decode` are None.
- otherwise `decode` names a worker that can decode (role decode or both, not draining), and
  `prefill` names a worker that can prefill (role prefill or both), or is None: the decode
  worker prefills the prompt itself (conditional disaggregation, or a colocated worker).
- the estimates are in seconds and never negative.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

from kvpool.errors import InvalidArgument
from kvpool.router.cost import CostParams


@dataclass(frozen=True)
class WorkerView:
    """One worker as a policy sees it, for one request."""

    name: str
    role: str  # prefill | decode | both
    queue_tokens: int = 0  # prompt tokens queued on it still to be computed
    active_sequences: int = 0  # decode batch now, plus decodes sent to it not yet reported
    kv_tokens: int = 0
    max_batch: int = 32
    local_prefix_chunks: int = 0  # leading chunks of this prompt in its own prefix cache
    local_cache_chunks: int = 0  # chunks its own prefix cache holds in all (what its KV events told)

    @property
    def prefills(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def decodes(self) -> bool:
        return self.role in ("decode", "both")


@dataclass(frozen=True)
class Targets:
    ttft_s: float | None = None  # refuse (429) when the best estimated TTFT is above this
    tbt_s: float | None = None  # a decode worker must keep its time between tokens under this
    local_prefill_tokens: int = 0  # uncached work at most this small is prefilled by the decode worker


@dataclass(frozen=True)
class RouteRequest:
    seq: int  # arrival number (round robin's only input)
    prompt_tokens: int
    max_tokens: int
    chunk_tokens: int
    pool_prefix_chunks: int  # leading chunks of the prompt present in the pool (one match_prefix)
    bytes_per_token: int
    pool_matched: bool = False  # the pool answered that match_prefix (else the 0 above is a guess)


@dataclass(frozen=True)
class Snapshot:
    workers: tuple[WorkerView, ...]
    cost: CostParams = field(default_factory=CostParams)
    targets: Targets = field(default_factory=Targets)


@dataclass(frozen=True)
class Decision:
    prefill: str | None
    decode: str | None
    est_ttft_s: float = 0.0
    est_tbt_s: float = 0.0
    cached_tokens: int = 0  # prompt tokens the chosen prefiller will not compute
    kind: str = "disaggregated"  # disaggregated | local_prefill | colocated | rejected | unavailable
    reject: str | None = None


class Policy(Protocol):
    """`choose` must be pure: same request and snapshot, same decision."""

    name: str

    def choose(self, req: RouteRequest, snap: Snapshot) -> Decision: ...


# -- estimates shared by the policies -------------------------------------------------------------


def cached_tokens(req: RouteRequest, w: WorkerView) -> int:
    """Prompt tokens `w` would not compute: the longer of its local run and the pool's run. At
    least one token is always computed (its logits give the first token)."""
    chunks = max(w.local_prefix_chunks, req.pool_prefix_chunks)
    return min(chunks * req.chunk_tokens, req.prompt_tokens - 1)


def prefill_estimate(req: RouteRequest, w: WorkerView, cost: CostParams) -> float:
    """Queue wait + computing the uncached tokens + fetching from the pool what `w` lacks locally.

    On a worker that also decodes, each prefill chunk shares its step with the batch's decode
    tokens, which add what each sequence adds to a step."""
    cached = cached_tokens(req, w)
    computed = req.prompt_tokens - cached
    fetch_chunks = max(0, req.pool_prefix_chunks - w.local_prefix_chunks)
    fetch_tokens = min(fetch_chunks * req.chunk_tokens, cached)
    wait = cost.prefill_s(w.queue_tokens, 0) if w.queue_tokens else 0.0
    total = wait + cost.prefill_s(computed, cached) + cost.fetch_s(fetch_tokens * req.bytes_per_token)
    if w.decodes and w.active_sequences:
        steps = -(-(w.queue_tokens + computed) // max(1, cost.interleave_tokens))
        total += steps * w.active_sequences * cost.decode_token_s
    return total


def tbt_estimate(w: WorkerView, cost: CostParams) -> float:
    """Time between tokens once one more sequence joins `w`'s batch: one step of that batch."""
    return cost.decode_step_s + (min(w.active_sequences, w.max_batch) + 1) * cost.decode_token_s


def _decoders(snap: Snapshot) -> list[WorkerView]:
    return [w for w in snap.workers if w.decodes]


def _prefillers(snap: Snapshot) -> list[WorkerView]:
    """Dedicated prefill workers if there are any, else colocated ones."""
    dedicated = [w for w in snap.workers if w.role == "prefill"]
    return dedicated or [w for w in snap.workers if w.role == "both"]


def _finish(req: RouteRequest, snap: Snapshot, p: WorkerView | None, d: WorkerView) -> Decision:
    """Estimates for a fixed choice; `p` None: `d` prefills too."""
    pre = p or d
    ttft = prefill_estimate(req, pre, snap.cost)
    kind = "colocated" if d.role == "both" and (p is None or p.name == d.name) else (
        "local_prefill" if p is None else "disaggregated")
    if kind == "disaggregated":
        ttft += snap.cost.handoff_s
    return Decision(prefill=p.name if p is not None and p.name != d.name else None, decode=d.name,
                    est_ttft_s=ttft, est_tbt_s=tbt_estimate(d, snap.cost),
                    cached_tokens=cached_tokens(req, pre), kind=kind)


def _no_workers(snap: Snapshot) -> Decision | None:
    if not _decoders(snap):
        return Decision(None, None, kind="unavailable", reject="no decode-capable worker is serving")
    return None


# -- the policies ---------------------------------------------------------------------------------


class RoundRobin:
    """Take turns, ignoring load and cache: the baseline."""

    name = "round_robin"

    def choose(self, req: RouteRequest, snap: Snapshot) -> Decision:
        if (none := _no_workers(snap)) is not None:
            return none
        decoders = _decoders(snap)
        d = decoders[req.seq % len(decoders)]
        prefillers = _prefillers(snap)
        if d.role == "both" or not prefillers:
            return _finish(req, snap, None, d)
        return _finish(req, snap, prefillers[req.seq % len(prefillers)], d)


class LeastLoaded:
    """Fewest queued prompt tokens for prefill, fewest running sequences for decode; no cache."""

    name = "least_loaded"

    def choose(self, req: RouteRequest, snap: Snapshot) -> Decision:
        if (none := _no_workers(snap)) is not None:
            return none
        d = min(_decoders(snap), key=lambda w: (w.active_sequences + (w.queue_tokens > 0), w.kv_tokens, w.name))
        prefillers = _prefillers(snap)
        if d.role == "both" or not prefillers:
            return _finish(req, snap, None, d)
        return _finish(req, snap, min(prefillers, key=lambda w: (w.queue_tokens, w.name)), d)


class CacheAware:
    """Mooncake's Conductor: the prefill worker with the least estimated TTFT (queue wait,
    compute of the uncached tokens, fetch of the pool-cached bytes; a prefix in the worker's own
    cache costs no fetch), the least loaded decode worker that meets the TBT target, the decode
    worker itself when the uncached work is small, and an early refusal when nothing meets the
    targets.

    A prefill on a worker that is also decoding stalls each of its running sequences for the
    prefill's compute time, so such a candidate is ranked by its TTFT plus that stall times the
    sequences it holds up (total added latency, not only this request's). Where a prefill worker
    can take the work instead, a decode worker's own prefill is a candidate only if its stall is
    at most one token's gap on that worker (or the hand-off it saves), and within the TBT target:
    on a GPU a few hundred tokens prefill in about a decode step; on a CPU they take many, and
    would hold up the sequences running now and those arriving meanwhile.

    Ties (a prefix no worker holds, every worker idle) go to the worker whose own cache holds
    least: new prefixes spread over the workers' caches. Broken by name, every cold conversation
    landed on the first worker, whose cache then evicted them while the others sat empty, and the
    next round found its prefix nowhere (issue 9, `kvpool bench policies --workload local-caches`)."""

    name = "cache_aware"

    def choose(self, req: RouteRequest, snap: Snapshot) -> Decision:
        if (none := _no_workers(snap)) is not None:
            return none
        cost, targets = snap.cost, snap.targets
        decoders = _decoders(snap)
        tbt_ok = [w for w in decoders if targets.tbt_s is None or tbt_estimate(w, cost) <= targets.tbt_s]
        pool = tbt_ok or decoders
        prefillers = [w for w in snap.workers if w.role == "prefill"]
        candidates: list[tuple[float, int, Decision]] = []  # (score, prefiller's cache fill, decision)

        def on_decoder(w: WorkerView, elsewhere: bool) -> None:  # `w` prefills, decoding others meanwhile
            stall = cost.prefill_s(req.prompt_tokens - cached_tokens(req, w), cached_tokens(req, w))
            if elsewhere and (stall > max(cost.handoff_s, tbt_estimate(w, cost))
                              or targets.tbt_s is not None and tbt_estimate(w, cost) + stall > targets.tbt_s):
                return
            c = _finish(req, snap, None, w)
            candidates.append((c.est_ttft_s + stall * min(w.active_sequences, w.max_batch), w.local_cache_chunks, c))

        for w in pool:
            if w.role == "both":
                on_decoder(w, elsewhere=False)
        dedicated = [w for w in pool if w.role == "decode"]
        if dedicated:
            d = min(dedicated, key=lambda w: (w.active_sequences, w.kv_tokens, w.name))
            if not prefillers or req.prompt_tokens - cached_tokens(req, d) <= targets.local_prefill_tokens:
                on_decoder(d, elsewhere=bool(prefillers))
            for p in prefillers:
                c = _finish(req, snap, p, d)
                candidates.append((c.est_ttft_s, p.local_cache_chunks, c))
        *_, best = min(candidates, key=lambda sc: (sc[0], sc[2].est_tbt_s, sc[1], sc[2].prefill or "",
                                                   sc[2].decode or ""))
        too_slow = targets.ttft_s is not None and best.est_ttft_s > targets.ttft_s
        if not tbt_ok or too_slow:
            why = (f"estimated TTFT {best.est_ttft_s * 1e3:.0f} ms exceeds the {targets.ttft_s * 1e3:.0f} ms target"
                   if too_slow else f"every decode worker would exceed the {targets.tbt_s * 1e3:.0f} ms "
                   f"time-between-tokens target (best {best.est_tbt_s * 1e3:.0f} ms)")
            return Decision(None, None, est_ttft_s=best.est_ttft_s, est_tbt_s=best.est_tbt_s,
                            kind="rejected", reject=why)
        return best


POLICIES: dict[str, type] = {p.name: p for p in (RoundRobin, LeastLoaded, CacheAware)}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise InvalidArgument(f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}") from None


def without_workers(snap: Snapshot, names: Sequence[str]) -> Snapshot:
    """The snapshot without the named workers (a retry avoids the one that just failed)."""
    return Snapshot(tuple(w for w in snap.workers if w.name not in names), snap.cost, snap.targets)
