"""Performance profiles: how long an instance takes to prefill, to step a decode batch, and to
move KV bytes. A profile is data (JSON), so a calibrated one (`kvpool sim calibrate`) and a
roofline-derived one (`roofline.py`) are used the same way.

    prefill_s(c computed, k cached) = p0 + max(p_floor, p_tok*c + p_attn*c*(k + c/2))
    decode step(B sequences, kv tokens in the batch)
        = d0 + d_seq*B + max(d_weights + d_kv*kv, d_tok*B)
    join(a handed-off sequence of kv tokens) = d_join_kv*kv, once, in the first step it is in

The prefill form is the router's cost model (`kvpool/router/cost.py`) with a memory floor (a
GPU reads all weights once per forward however few tokens it computes). The decode form has a
per-sequence part (`d_seq`: each sequence's rows of the matmuls and its own attention) and a
roofline part (weights + KV read, overlapped with the batch's matmuls; on a CPU, calibrated by
`kvpool sim calibrate`, the fixed part `d_weights` is mostly the weights read). A colocated
iteration that runs one prefill chunk next to a decode step costs the sum of both (`fused`
false) or one fused forward (`fused` true: the chunk batched with the decode tokens,
Sarathi-style, as the reference engine and GPU engines do). An engine that assembles a handed-off
sequence's KV inside the step that first includes it makes that step longer for the whole batch
by `d_join_kv` per KV token (0 for the reference engine: it assembles the KV before the join).

Invariants: every time is in seconds and never negative; `decode_steps_s` is increasing in the
number of steps, so `steps_within` can bisect it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from kvpool.errors import InvalidArgument
from kvpool.router.cost import CostParams

PROFILE_VERSION = 1


@dataclass(frozen=True)
class Profile:
    name: str
    description: str = ""
    # prefill
    p0: float = 0.02
    p_tok: float = 2e-3
    p_attn: float = 0.0
    p_floor: float = 0.0
    # decode step
    d0: float = 0.0
    d_seq: float = 0.02
    d_weights: float = 0.0
    d_kv: float = 0.0
    d_tok: float = 0.0
    d_join_kv: float = 0.0  # a handed-off sequence's first step: its KV assembled into the engine's cache
    fused: bool = False
    prefill_chunk_tokens: int = 512  # chunk of a prefill interleaved with decode (colocated)
    # KV movement
    bytes_per_token: int = 46080
    link_bytes_per_s: float = 1e9  # instance <-> pool network (each instance)
    dram_read_bytes_per_s: float = 5e9
    ssd_read_bytes_per_s: float = 1e9
    push_bytes_per_s: float = 1e9  # writing new KV into the pool
    pull_bytes_per_s: float = 0.0  # a decode instance loading a prompt's KV into its engine (0: the link rate)
    pull_fixed_s: float = 0.0  # and the fixed part of that hand-off (admission, handle check, pool pin)
    rpc_s: float = 0.002  # one control-plane hop (router -> worker) on the critical path
    # capacity and money
    max_batch: int = 32
    max_kv_tokens: int = 65536
    price_per_hour: float = 0.0  # per instance (all its cards)
    cards: int = 1
    card: str = "cpu"
    model: str = ""
    version: int = PROFILE_VERSION

    # -- timing ------------------------------------------------------------------------------------
    def prefill_s(self, computed: int, cached: int) -> float:
        if computed <= 0:
            return 0.0
        return self.p0 + max(self.p_floor, self.p_tok * computed + self.p_attn * computed * (cached + computed / 2))

    def decode_step_s(self, batch: int, kv_tokens: int) -> float:
        if batch <= 0:
            return 0.0
        return self.d0 + self.d_seq * batch + max(self.d_weights + self.d_kv * kv_tokens, self.d_tok * batch)

    def join_s(self, kv_tokens: int) -> float:
        """Extra time of the step that first includes handed-off sequences holding `kv_tokens`."""
        return self.d_join_kv * kv_tokens if kv_tokens > 0 else 0.0

    def decode_steps_s(self, batch: int, kv0: int, steps: int) -> float:
        """Time of `steps` consecutive steps of a fixed batch whose KV starts at `kv0` tokens and
        grows by `batch` each step (closed form of the sum of `decode_step_s`)."""
        if steps <= 0 or batch <= 0:
            return 0.0
        base = self.d0 + self.d_seq * batch
        compute = self.d_tok * batch
        mem0 = self.d_weights + self.d_kv * kv0
        slope = self.d_kv * batch
        if slope <= 0:
            return steps * (base + max(mem0, compute))
        # steps 0..below-1 are compute-bound (memory time under the compute time), the rest memory-bound
        gap = compute - mem0
        below = 0 if gap <= 0 else steps if gap >= slope * steps else min(steps, math.ceil(gap / slope))
        mem_sum = (steps - below) * mem0 + slope * ((steps - 1) * steps // 2 - (below - 1) * below // 2)
        return steps * base + below * compute + mem_sum

    def steps_within(self, batch: int, kv0: int, seconds: float) -> int:
        """Most steps that complete within `seconds`."""
        if seconds <= 0 or batch <= 0:
            return 0
        hi = 1
        while self.decode_steps_s(batch, kv0, hi) <= seconds:
            hi *= 2
        lo = hi // 2  # decode_steps_s(lo) <= seconds (or lo == 0)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.decode_steps_s(batch, kv0, mid) <= seconds:
                lo = mid
            else:
                hi = mid
        return lo

    def mixed_s(self, batch: int, kv_tokens: int, computed: int, cached: int) -> float:
        """One colocated iteration: a decode step of `batch` sequences plus a prefill chunk."""
        if batch <= 0:
            return self.prefill_s(computed, cached)
        if computed <= 0:
            return self.decode_step_s(batch, kv_tokens)
        if not self.fused:
            return self.decode_step_s(batch, kv_tokens) + self.prefill_s(computed, cached)
        chunk = self.p_tok * computed + self.p_attn * computed * (cached + computed / 2)
        return self.p0 + self.d_seq * batch + max(self.d_weights + self.d_kv * kv_tokens, self.d_tok * batch + chunk)

    def fetch_s(self, dram_bytes: int, ssd_bytes: int) -> float:
        """Reading cached KV from the pool: each tier's read and the network, pipelined (the
        slowest stage sets the pace)."""
        nbytes = dram_bytes + ssd_bytes
        if nbytes <= 0:
            return 0.0
        return max(nbytes / self.link_bytes_per_s, dram_bytes / self.dram_read_bytes_per_s
                   + ssd_bytes / self.ssd_read_bytes_per_s)

    def pull_s(self, nbytes: int) -> float:
        """A decode instance loading a handed-off prompt's KV (pool read, unpacking into the engine)."""
        if nbytes <= 0:
            return 0.0
        rate = nbytes / self.pull_bytes_per_s if self.pull_bytes_per_s > 0 else self.fetch_s(nbytes, 0)
        return self.pull_fixed_s + rate

    def push_s(self, nbytes: int) -> float:
        return nbytes / self.push_bytes_per_s if nbytes > 0 else 0.0

    def cost_params(self) -> CostParams:
        """The router cost model's prior from this profile (the simulator then fits it online,
        as the router does)."""
        batch = max(1, self.max_batch // 4)  # the line through steps of B and 2B sequences of 2048 tokens each
        one, two = self.decode_step_s(batch, batch * 2048), self.decode_step_s(2 * batch, 2 * batch * 2048)
        per_seq = max(0.0, (two - one) / batch)
        return CostParams(prefill_fixed_s=self.p0, prefill_token_s=self.p_tok, prefill_attn_s=self.p_attn,
                          fetch_bytes_per_s=min(self.link_bytes_per_s, self.dram_read_bytes_per_s),
                          decode_token_s=per_seq, decode_step_s=max(0.0, one - per_seq * batch),
                          handoff_s=2 * self.rpc_s,
                          interleave_tokens=self.prefill_chunk_tokens)

    # -- storage -----------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict) -> "Profile":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(doc) - known)
        if unknown:
            raise InvalidArgument(f"profile has unknown fields {unknown}")
        if doc.get("version", PROFILE_VERSION) != PROFILE_VERSION:
            raise InvalidArgument(f"profile version {doc.get('version')} is not {PROFILE_VERSION}")
        prof = cls(**doc)
        for f in fields(cls):
            value = getattr(prof, f.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
                raise InvalidArgument(f"profile field {f.name} must not be negative, got {value}")
        return prof

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        tmp.replace(path)
        return path

    def with_price(self, price_per_hour: float | None) -> "Profile":
        return self if price_per_hour is None else replace(self, price_per_hour=price_per_hour)


def local_profile_path() -> Path:
    """Where `kvpool sim calibrate` writes the `local` profile (KVPOOL_SIM_PROFILE overrides)."""
    env = os.environ.get("KVPOOL_SIM_PROFILE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvpool" / "sim" / "local.json"


def profile_names() -> list[str]:
    from kvpool.tools.sim.roofline import GPU_PROFILES

    return ["local", *sorted(GPU_PROFILES)]


def load_profile(name: str) -> Profile:
    """A profile by name (`local`, a GPU profile) or by path to a JSON file."""
    from kvpool.tools.sim.roofline import GPU_PROFILES, gpu_profile

    if name in GPU_PROFILES:
        return gpu_profile(name)
    path = local_profile_path() if name == "local" else Path(name)
    if name == "local" and not path.is_file():
        raise InvalidArgument(f"no local profile at {path}: run `kvpool sim calibrate` first "
                              f"(or pass a profile file, or one of {profile_names()[1:]})")
    if not path.is_file():
        raise InvalidArgument(f"unknown profile {name!r}: not a file, and not one of {profile_names()}")
    try:
        return Profile.from_json(json.loads(path.read_text()))
    except (ValueError, TypeError) as exc:
        raise InvalidArgument(f"{path}: not a profile ({exc})") from None
