"""What `kvpool bench serve` measures per request and how it sums up a run, with the metric
definitions of `vllm bench serve`:

- TTFT: request sent -> first chunk with content;
- TPOT: (e2e - TTFT) / (output tokens - 1), per request with more than one output token;
- ITL: every gap between successive content chunks, all requests pooled;
- E2E: request sent -> last byte of the stream;
- throughputs over the run's duration (first request sent -> last one finished), counting
  completed requests only; goodput: completed requests per second that meet every SLO given
  (a request with one output token counts as TPOT 0 there, as in vLLM).

Latencies are recorded in seconds and reported in milliseconds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)
SLO_METRICS = {"ttft": "ttft", "tpot": "tpot", "e2e": "e2e", "e2el": "e2e"}  # accepted name -> ours


@dataclass
class RequestRecord:
    """One request's outcome. Times in seconds; `sent_s` is relative to the run's start."""

    index: int
    success: bool = False
    sent_s: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None
    status: int | None = None
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        for key in ("sent_s", "ttft", "latency"):
            doc[key] = round(doc[key], 6)
        doc["itl"] = [round(x, 6) for x in self.itl]
        return doc


@dataclass
class Stats:
    """Mean, median, std and tail percentiles of one metric, in ms (all 0 without samples, as vLLM)."""

    mean: float = 0.0
    median: float = 0.0
    std: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    count: int = 0

    @classmethod
    def of(cls, seconds: list[float]) -> Stats:
        if not seconds:
            return cls()
        ms = np.asarray(seconds, dtype=np.float64) * 1e3
        p50, p90, p99 = np.percentile(ms, PERCENTILES)
        return cls(mean=float(ms.mean()), median=float(p50), std=float(ms.std()), p90=float(p90),
                   p99=float(p99), count=int(ms.size))


@dataclass
class ServeMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft: Stats
    tpot: Stats
    itl: Stats
    e2e: Stats
    goodput: float | None = None
    mean_cached_tokens: float | None = None
    errors: list[str] = field(default_factory=list)

    def flat(self) -> dict[str, Any]:
        """`ttft_mean`, `ttft_p99`, ... and the scalars, for the JSON run record."""
        doc: dict[str, Any] = {}
        for key, value in asdict(self).items():
            if isinstance(value, dict):  # a Stats
                doc.update({f"{key}_{stat}": (round(v, 4) if isinstance(v, float) else v) for stat, v in value.items()})
            elif isinstance(value, float):
                doc[key] = round(value, 4)
            else:
                doc[key] = value
        return doc


def parse_slo(spec: str) -> tuple[str, float]:
    """`ttft:500` -> ("ttft", 500.0 ms); names as vLLM's `--goodput` (ttft, tpot, e2el) plus `e2e`."""
    name, sep, value = spec.partition(":")
    name = name.strip().lower()
    if not sep or name not in SLO_METRICS:
        raise ValueError(f"bad SLO {spec!r}: expected NAME:MS with NAME one of ttft, tpot, e2e")
    try:
        ms = float(value)
    except ValueError:
        raise ValueError(f"bad SLO {spec!r}: {value!r} is not a number of milliseconds") from None
    if ms <= 0:
        raise ValueError(f"bad SLO {spec!r}: must be positive")
    return SLO_METRICS[name], ms


def meets_slos(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    values = {"ttft": record.ttft, "tpot": record.tpot or 0.0, "e2e": record.latency}
    return all(values[name] * 1e3 <= limit for name, limit in slos_ms.items())


def summarize(records: list[RequestRecord], duration_s: float, slos_ms: dict[str, float] | None = None,
              max_errors: int = 5) -> ServeMetrics:
    """Sum up one run: `records` of every request sent, `duration_s` from first send to last finish."""
    done = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    total_in = sum(r.prompt_tokens for r in done)
    total_out = sum(r.output_tokens for r in done)
    cached = [r.cached_tokens for r in done if r.cached_tokens is not None]
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    return ServeMetrics(
        completed=len(done), failed=len(failed), duration_s=duration_s,
        total_input_tokens=total_in, total_output_tokens=total_out,
        request_throughput=per_s(len(done)), output_throughput=per_s(total_out),
        total_token_throughput=per_s(total_in + total_out),
        ttft=Stats.of([r.ttft for r in done]),
        tpot=Stats.of([t for r in done if (t := r.tpot) is not None]),
        itl=Stats.of([gap for r in done for gap in r.itl]),
        e2e=Stats.of([r.latency for r in done]),
        goodput=per_s(sum(meets_slos(r, slos_ms) for r in done)) if slos_ms else None,
        mean_cached_tokens=float(np.mean(cached)) if cached else None,
        errors=[f"request {r.index}: {r.error}" for r in failed[:max_errors]],
    )
