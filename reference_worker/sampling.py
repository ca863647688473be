"""How the next token is picked from a position's logits: greedy, or seeded temperature + top-p.

Greedy (no params, or temperature 0) is a plain argmax, the same call as before sampling existed,
so greedy output stays bit-equal to `model.generate`.

Sampled tokens are reproducible across workers: token `index` of a request (0 = the prefill's
first token, 1 = the first decode token, ...) is drawn with a fresh `torch.Generator` seeded from
(seed, index) alone. A prefill worker and a decode worker therefore pick the same tokens as one
`both` worker, given the same logits (bit-equal on the straight handoff; a chunked or split
prefill moves logits by ~1e-5, which can move a draw that lands on a boundary).
"""

from __future__ import annotations

import struct

import torch
import xxhash

from kvpool.errors import InvalidArgument
from kvpool.worker_api import SamplingParams

MAX_TEMPERATURE = 2.0
_U64 = (1 << 64) - 1


def check(params: SamplingParams | None) -> SamplingParams | None:
    """The params if they are in range (temperature [0, 2], top_p (0, 1]); `InvalidArgument` if not.
    Written as `not (lo <= x <= hi)` so that NaN is refused too."""
    if params is None:
        return None
    if not 0.0 <= params.temperature <= MAX_TEMPERATURE:
        raise InvalidArgument(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {params.temperature}")
    if not 0.0 < params.top_p <= 1.0:
        raise InvalidArgument(f"top_p must be in (0, 1], got {params.top_p}")
    return params


def is_greedy(params: SamplingParams | None) -> bool:
    return params is None or params.temperature == 0.0


def generator_for(seed: int, index: int) -> torch.Generator:
    """A generator that depends on (seed, index) only. Hashed rather than `seed + index` so that
    seed s at position i+1 and seed s+1 at position i do not share a stream."""
    mixed = xxhash.xxh3_64_intdigest(struct.pack("<QQ", seed & _U64, index & _U64))
    return torch.Generator(device="cpu").manual_seed(mixed)


def pick(logits: torch.Tensor, params: SamplingParams | None, index: int) -> int:
    """The token for position `index` of a request from that position's logits (1-D, vocab)."""
    if is_greedy(params):
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.detach().to(torch.float32) / params.temperature, dim=-1)
    # stable: equal probabilities keep vocabulary order, so the kept set never depends on the sort
    sorted_probs, order = torch.sort(probs, descending=True, stable=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    # nucleus: the smallest prefix whose mass reaches top_p (the top token always stays)
    sorted_probs = torch.where(mass_before < params.top_p, sorted_probs, torch.zeros_like(sorted_probs))
    kept = int(torch.count_nonzero(sorted_probs))
    cdf = torch.cumsum(sorted_probs, dim=-1)
    # inverse CDF with one uniform draw: cheap, and one number per position keeps streams aligned
    u = torch.rand((), generator=generator_for(params.seed, index), dtype=torch.float32)
    rank = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    return int(order[min(rank, max(kept - 1, 0))])
