"""The cost model a policy estimates with, fitted online from the workers' own timings.

    prefill_s(computed c, cached k) = a + b*c + q*c*(k + c/2)

`a` is the per-request overhead, `b` the per-token cost of the dense layers, `q` attention: each
computed token attends to the cached tokens and, on average, half of the computed ones. The
coefficients are a least-squares fit (non-negative) over the most recent prefill reports
(`PrefillResponse.compute_ms` with its computed and cached token counts); until enough samples
exist, the defaults (or a profile's values) stand. The pool's fetch rate is a moving average of
`fetch_ms` over the bytes fetched. A decode step of B sequences takes
`decode_step_s + B * decode_token_s`, moving averages of the line each worker fits over its own
steps (`decode_step_ms`, `decode_token_ms` in its load report).

`CostParams` is the frozen snapshot a policy reads; `CostModel` is the mutable fitter the router
feeds. The simulator builds `CostParams` from a performance profile instead.
"""

from __future__ import annotations

import collections
import statistics
import threading
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class CostParams:
    prefill_fixed_s: float = 0.02
    prefill_token_s: float = 2e-3
    prefill_attn_s: float = 0.0  # per (computed token x attended token)
    fetch_bytes_per_s: float = 1e9
    decode_token_s: float = 0.02  # what each sequence adds to a decode step
    decode_step_s: float = 0.0  # what every decode step costs whatever its batch (a batching engine's weights read)
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
        # measured rates, by their `CostParams` field: moving averages (each new value weighs 0.2)
        self._rates: dict[str, float] = {}
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
                self._average("fetch_bytes_per_s", fetched_bytes / fetch_s)
            self._dirty = True

    def observe_decode(self, token_s: float, step_s: float = 0.0) -> None:
        """A worker's decode line: `step_s + B * token_s` for a step of B sequences."""
        if token_s > 0 or step_s > 0:
            with self._lock:
                self._average("decode_token_s", token_s)
                self._average("decode_step_s", step_s)
                self._dirty = True

    def observe_handoff(self, seconds: float) -> None:
        """Measured disaggregation overhead: pushing the KV to the pool plus the extra HTTP call."""
        if seconds >= 0:
            with self._lock:
                self._average("handoff_s", seconds)
                self._dirty = True

    def _average(self, name: str, value: float) -> None:  # with _lock held
        prev = self._rates.get(name)
        self._rates[name] = value if prev is None else 0.8 * prev + 0.2 * value

    def params(self) -> CostParams:
        """The current estimates. The least-squares fit (~0.1 ms of CPU, on the route's path)
        runs again once the new prefill samples are a sixteenth of the window's (every sample
        while it holds fewer than 32, every 8th once it is full): one sample moves a fit over 128
        by little. A decode token or a hand-off (many per request) only updates its own rate."""
        with self._lock:
            if self._dirty:
                if self._new and self._new >= len(self._samples) // 16:
                    self._fitted = self._fit_prefill()
                    self._new = 0
                self._params = replace(self._fitted, **self._rates)
                self._dirty = False
            return self._params

    @property
    def samples(self) -> int:
        return len(self._samples)

    def _fit_prefill(self) -> CostParams:
        p = self._prior
        if len(self._samples) >= self._min_samples:
            x = [(1.0, float(c), c * (k + c / 2)) for c, k, _ in self._samples]
            coef = _nnls3(x, [t for _, _, t in self._samples])
            if coef is not None:
                p = replace(p, prefill_fixed_s=coef[0], prefill_token_s=coef[1], prefill_attn_s=coef[2])
        return p


class DecodeLine:
    """What a decode step costs as a line in its batch size, `base_s + per_seq_s * B`, fitted by
    least squares over the last `window` decode-only steps (a step shared with a prefill chunk
    says nothing of decode's own cost). `base_s` is what every step pays whatever its batch
    (reading the weights, on a CPU most of it); `per_seq_s` what each sequence adds (its
    attention over its KV, its share of the matmuls). Until the steps seen span two batch sizes,
    the line goes through the origin (`per_seq_s` = mean time per sequence): an overestimate for
    larger batches, never an underestimate. A reference worker reports its line in `/load`; the
    simulator's instances keep one the same way."""

    def __init__(self, window: int = 128):
        self._steps: collections.deque[tuple[int, float]] = collections.deque(maxlen=window)
        self._fit: tuple[float, float] = (0.0, 0.0)
        self._new = 0

    def observe(self, batch: int, seconds: float) -> None:
        self._steps.append((batch, seconds))
        self._new += 1

    def fit(self) -> tuple[float, float]:
        """(base_s, per_seq_s); (0, 0) before any step."""
        if self._new:
            self._new = 0
            try:
                slope, base = statistics.linear_regression(*zip(*self._steps))
            except statistics.StatisticsError:  # a single batch size so far
                slope = base = 0.0
            if slope <= 0 or base < 0:
                base, slope = 0.0, sum(t / b for b, t in self._steps) / len(self._steps)
            self._fit = (base, slope)
        return self._fit


def _nnls3(x: list[tuple[float, float, float]], t: list[float]) -> list[float] | None:
    """Least squares with non-negative coefficients for 3 columns: try every subset of active
    columns (7 small solves) and keep the best feasible one. Columns are scaled so they compare.

    Pure Python on the 3x3 normal equations, not numpy: this runs on a request's route, and
    numpy's LAPACK hands even a 128x3 solve to OpenBLAS threads, which on a machine whose cores
    are busy with prefills waited milliseconds to be scheduled (py-spy, the router's route path)."""
    scale = [max(max(abs(row[j]) for row in x), 1e-12) for j in range(3)]
    i0, i1, i2 = 1.0 / scale[0], 1.0 / scale[1], 1.0 / scale[2]
    g00 = g01 = g02 = g11 = g12 = g22 = b0 = b1 = b2 = tt = 0.0
    for (r0, r1, r2), ti in zip(x, t):
        r0, r1, r2 = r0 * i0, r1 * i1, r2 * i2
        g00 += r0 * r0
        g01 += r0 * r1
        g02 += r0 * r2
        g11 += r1 * r1
        g12 += r1 * r2
        g22 += r2 * r2
        b0 += r0 * ti
        b1 += r1 * ti
        b2 += r2 * ti
        tt += ti * ti
    gram = ((g00, g01, g02), (g01, g11, g12), (g02, g12, g22))
    xt = (b0, b1, b2)
    best, best_err = None, float("inf")
    for mask in range(1, 8):
        cols = [i for i in range(3) if mask >> i & 1]
        sol = _solve([[gram[i][j] for j in cols] for i in cols], [xt[i] for i in cols])
        if sol is None or any(v < 0 for v in sol):
            continue
        # |X b - t|^2 = t.t - 2 b.(X^T t) + b^T (X^T X) b
        err = tt - 2 * sum(v * xt[i] for v, i in zip(sol, cols)) + sum(
            sol[a] * sol[b] * gram[i][j] for a, i in enumerate(cols) for b, j in enumerate(cols))
        if err < best_err:
            full = [0.0, 0.0, 0.0]
            for v, i in zip(sol, cols):
                full[i] = v / scale[i]
            best, best_err = full, err
    return best


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """`a x = b` for a small symmetric positive semi-definite `a` (Gaussian elimination with
    partial pivoting); None when `a` is singular (those columns are collinear in the samples)."""
    n = len(b)
    m = [row[:] + [rhs] for row, rhs in zip(a, b)]
    tiny = 1e-12 * max(max(abs(v) for v in row[:n]) for row in m)
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) <= tiny:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (m[r][n] - sum(m[r][c] * out[c] for c in range(r + 1, n))) / m[r][r]
    return out
