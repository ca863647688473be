"""What the simulator replays: requests with an arrival time, prompt and answer lengths, and the
ids of the prompt's KV blocks (a prefix-hash chain: equal ids at the same position mean the same
prefix, so block i is reusable only if blocks 0..i-1 are).

Sources:
- a Mooncake-format JSONL trace (`timestamp` ms, `input_length`, `output_length`, `hash_ids` of
  512-token blocks; the last block may be partial);
- a synthetic workload (Poisson arrivals; a few shared system prompts, multi-turn sessions);
- a `kvpool bench` workload already tokenized (see `from_token_lists`), for validation against
  the real cluster, where block ids come from the real chunk-key chain.

`reuse_upper_bound` is the block hit ratio with unlimited capacity when every block is usable as
soon as its request arrives: what the trace's own ids allow, the ceiling for any simulation.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Sequence

from kvpool.errors import InvalidArgument

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class SimRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    blocks: tuple[int, ...]  # prefix-chained block ids, ceil(prompt_tokens / block_tokens) of them


@dataclass(frozen=True)
class Workload:
    requests: tuple[SimRequest, ...]
    block_tokens: int
    name: str = ""

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def span_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0

    @property
    def rate(self) -> float:
        """Offered request rate (req/s) over the span of arrivals."""
        return (len(self.requests) - 1) / self.span_s if self.span_s > 0 else float("inf")

    def scaled(self, rate_scale: float) -> "Workload":
        """The same requests arriving `rate_scale` times as fast (2.0: twice the rate)."""
        if not rate_scale > 0:
            raise InvalidArgument(f"rate scale must be positive, got {rate_scale!r}")
        if rate_scale == 1.0:
            return self
        t0 = self.requests[0].arrival_s if self.requests else 0.0
        reqs = tuple(replace(r, arrival_s=t0 + (r.arrival_s - t0) / rate_scale) for r in self.requests)
        return Workload(reqs, self.block_tokens, self.name)

    def head(self, n: int | None) -> "Workload":
        return self if n is None or n >= len(self.requests) else Workload(self.requests[:n], self.block_tokens,
                                                                          self.name)


def load_trace(path: str | Path, limit: int | None = None, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> Workload:
    """Read a Mooncake JSONL trace; arrivals are seconds from the first line, sorted."""
    path = Path(path)
    if not path.is_file():
        raise InvalidArgument(f"trace file not found: {path}")
    reqs: list[SimRequest] = []
    first_ms: float | None = None
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(reqs) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ts, n_in, n_out = float(row["timestamp"]), int(row["input_length"]), int(row["output_length"])
                ids = tuple(int(h) for h in row["hash_ids"])
            except (ValueError, KeyError, TypeError) as exc:
                raise InvalidArgument(f"{path}:{lineno}: not a Mooncake trace line ({type(exc).__name__}: {exc})") from None
            if n_in <= 0 or n_out < 0:
                raise InvalidArgument(f"{path}:{lineno}: input_length must be > 0 and output_length >= 0")
            first_ms = ts if first_ms is None else first_ms
            reqs.append(SimRequest((ts - first_ms) / 1e3, n_in, max(1, n_out), ids))
    if not reqs:
        raise InvalidArgument(f"{path}: no requests")
    reqs.sort(key=lambda r: r.arrival_s)
    return Workload(tuple(reqs), block_tokens, path.name)


def synthetic(num_requests: int, rate: float, *, system_prompts: int = 4, system_tokens: int = 2048,
              turn_tokens: int = 512, turns: int = 4, output_tokens: int = 256, block_tokens: int = 512,
              seed: int = 0) -> Workload:
    """Multi-turn chat sessions over shared system prompts, Poisson arrivals at `rate`/s.

    A session's turn k carries the system prompt and turns 1..k-1 (with their answers), so it
    shares a prefix with its own earlier turns and with every session on the same system prompt."""
    if num_requests <= 0 or not rate > 0:
        raise InvalidArgument("synthetic workload needs num_requests > 0 and rate > 0")
    rng = random.Random(f"sim-synthetic-{seed}")
    next_id = iter(range(1 << 62))
    systems = [[next(next_id) for _ in range(max(1, system_tokens // block_tokens))] for _ in range(system_prompts)]
    reqs: list[SimRequest] = []
    t = 0.0
    sessions: list[tuple[list[int], int, int]] = []  # (blocks so far, tokens so far, turns left)
    while len(reqs) < num_requests:
        t += rng.expovariate(rate)
        if not sessions or rng.random() < 1.0 / turns:
            sys_blocks = list(rng.choice(systems))
            sessions.append((sys_blocks, len(sys_blocks) * block_tokens, turns))
        i = rng.randrange(len(sessions))
        blocks, tokens, left = sessions[i]
        add = max(1, int(rng.uniform(0.5, 1.5) * turn_tokens))
        new_blocks = blocks + [next(next_id) for _ in range(-(-(tokens + add) // block_tokens) - len(blocks))]
        out = max(1, int(rng.uniform(0.5, 1.5) * output_tokens))
        reqs.append(SimRequest(t, tokens + add, out, tuple(new_blocks)))
        full = (tokens + add + out) // block_tokens  # the next turn reuses only full blocks
        carried = new_blocks[:full] + [next(next_id) for _ in range(full - len(new_blocks))]
        if left > 1:
            sessions[i] = (carried, full * block_tokens, left - 1)
        else:
            sessions.pop(i)
    return Workload(tuple(reqs), block_tokens, f"synthetic-{seed}")


def from_token_lists(prompts: Sequence[Sequence[int]], outputs: Sequence[int], arrivals: Sequence[float],
                     block_tokens: int) -> Workload:
    """Requests from real token ids: block i's id is the hash of tokens [0, (i+1)*block) (a prefix
    chain, as the pool's chunk keys), the partial last block included."""
    import xxhash

    reqs = []
    for ids, out, at in zip(prompts, outputs, arrivals):
        h = xxhash.xxh3_64()
        blocks = []
        for start in range(0, len(ids), block_tokens):
            h.update(b"".join(int(x).to_bytes(4, "little") for x in ids[start:start + block_tokens]))
            blocks.append(h.intdigest())
        reqs.append(SimRequest(float(at), len(ids), max(1, int(out)), tuple(blocks)))
    return Workload(tuple(sorted(reqs, key=lambda r: r.arrival_s)), block_tokens, "tokens")


def reuse_upper_bound(requests: Iterable[SimRequest], block_tokens: int) -> tuple[float, float]:
    """(block hit ratio, token hit ratio) with unlimited capacity, every block usable as soon as
    its request arrives, prefix hits only: in arrival order, a request's hit is its longest
    leading run of blocks seen in any earlier request."""
    seen: set[int] = set()
    hit_blocks = all_blocks = hit_tokens = all_tokens = 0
    for r in requests:
        n = 0
        for b in r.blocks:
            if b not in seen:
                break
            n += 1
        hit_blocks += n
        all_blocks += len(r.blocks)
        hit_tokens += min(r.prompt_tokens, n * block_tokens)
        all_tokens += r.prompt_tokens
        seen.update(r.blocks)
    return (hit_blocks / all_blocks if all_blocks else 0.0, hit_tokens / all_tokens if all_tokens else 0.0)
