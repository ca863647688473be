"""The cost model a policy estimates with, fitted online from the workers' own timings.

    prefill_s(computed c, cached k) = a + b*c + q*c*(k + c/2)

`a` is the per-request overhead, `b` the per-token cost of the dense layers, `q` attention: each
computed token attends to the cached tokens and, on average, half of the computed ones. The
coefficients are a least-squares fit (non-negative) over the most recent prefill reports
(`PrefillResponse.compute_ms` with its computed and cached token counts); until enough samples
exist, the defaults (or a profile's values) stand. The pool's fetch rate is a moving average of
`fetch_ms` over the bytes fetched; the per-sequence decode step time is the workers' own
`decode_token_ms`.

`CostParams` is the frozen snapshot a policy reads; `CostModel` is the mutable fitter the router
feeds. The simulator builds `CostParams` from a performance profile instead.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True)
class CostParams:
    prefill_fixed_s: float = 0.02
    prefill_token_s: float = 2e-3
    prefill_attn_s: float = 0.0  # per (computed token x attended token)
    fetch_bytes_per_s: float = 1e9
    decode_token_s: float = 0.02  # one sequence's share of a decode step
    handoff_s: float = 0.01  # disaggregation's own overhead: push, second call, pull
    interleave_tokens: int = 512  # a colocated worker runs one decode step per this many prefill tokens

    def prefill_s(self, computed: int, cached: int) -> float:
        if computed <= 0:
            return 0.0
        return self.prefill_fixed_s + self.prefill_token_s * computed + self.prefill_attn_s * computed * (
            cached + computed / 2)

    def fetch_s(self, nbytes: int) -> float:
        return nbytes / self.fetch_bytes_per_s if nbytes > 0 else 0.0


class CostModel:
    """Thread-safe online fit; `params()` is cheap (cached until the next sample)."""

    def __init__(self, prior: CostParams | None = None, window: int = 128, min_samples: int = 4):
        self._prior = prior or CostParams()
        self._samples: collections.deque[tuple[int, int, float]] = collections.deque(maxlen=window)
        self._min_samples = min_samples
        self._lock = threading.Lock()
        self._params = self._prior
        self._fetch_rate: float | None = None
        self._decode_token_s: float | None = None
        self._handoff_s: float | None = None
        self._fitted = self._prior  # the prior with the last prefill fit
        self._new = 0  # prefill samples since that fit
        self._dirty = False

    def observe_prefill(self, computed: int, cached: int, compute_s: float, fetched_bytes: int = 0,
                        fetch_s: float = 0.0) -> None:
        with self._lock:
            if computed > 0 and compute_s > 0:
                self._samples.append((computed, cached, compute_s))
                self._new += 1
            if fetched_bytes > 0 and fetch_s > 0:
                rate = fetched_bytes / fetch_s
                self._fetch_rate = rate if self._fetch_rate is None else 0.8 * self._fetch_rate + 0.2 * rate
            self._dirty = True

    def observe_decode_token(self, seconds: float) -> None:
        if seconds > 0:
            with self._lock:
                prev = self._decode_token_s
                self._decode_token_s = seconds if prev is None else 0.8 * prev + 0.2 * seconds
                self._dirty = True

    def observe_handoff(self, seconds: float) -> None:
        """Measured disaggregation overhead: pushing the KV to the pool plus the extra HTTP call."""
        if seconds >= 0:
            with self._lock:
                prev = self._handoff_s
                self._handoff_s = seconds if prev is None else 0.8 * prev + 0.2 * seconds
                self._dirty = True

    def params(self) -> CostParams:
        """The current estimates. The least-squares fit (~0.2 ms of CPU, on the route's path)
        runs again once the new prefill samples are a sixteenth of the window's (every sample
        while it holds fewer than 32, every 8th once it is full): one sample moves a fit over 128
        by little. A decode token or a hand-off (many per request) only updates its own rate."""
        with self._lock:
            if self._dirty:
                if self._new and self._new >= len(self._samples) // 16:
                    self._fitted = self._fit_prefill()
                    self._new = 0
                self._params = self._with_rates(self._fitted)
                self._dirty = False
            return self._params

    @property
    def samples(self) -> int:
        return len(self._samples)

    def _fit_prefill(self) -> CostParams:
        p = self._prior
        if len(self._samples) >= self._min_samples:
            arr = np.asarray(self._samples, dtype=np.float64)
            c, k, t = arr[:, 0], arr[:, 1], arr[:, 2]
            x = np.stack([np.ones_like(c), c, c * (k + c / 2)], axis=1)
            coef = _nnls3(x, t)
            if coef is not None:
                p = replace(p, prefill_fixed_s=coef[0], prefill_token_s=coef[1], prefill_attn_s=coef[2])
        return p

    def _with_rates(self, p: CostParams) -> CostParams:
        if self._fetch_rate is not None:
            p = replace(p, fetch_bytes_per_s=self._fetch_rate)
        if self._decode_token_s is not None:
            p = replace(p, decode_token_s=self._decode_token_s)
        if self._handoff_s is not None:
            p = replace(p, handoff_s=self._handoff_s)
        return p


def _nnls3(x: np.ndarray, t: np.ndarray) -> np.ndarray | None:
    """Least squares with non-negative coefficients for 3 columns: try every subset of active
    columns (8 small solves) and keep the best feasible one. Scaled so the columns compare."""
    scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
    xs = x / scale
    best, best_err = None, np.inf
    for mask in range(1, 8):
        cols = [i for i in range(3) if mask >> i & 1]
        sol, *_ = np.linalg.lstsq(xs[:, cols], t, rcond=None)
        if (sol < 0).any():
            continue
        err = float(np.sum((xs[:, cols] @ sol - t) ** 2))
        if err < best_err:
            full = np.zeros(3)
            full[cols] = sol
            best, best_err = full / scale, err
    return best
