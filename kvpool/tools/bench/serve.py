"""`kvpool bench serve`: load an OpenAI-compatible endpoint and report what `vllm bench serve`
reports (TTFT, TPOT, ITL, E2E, throughputs, goodput), plus the prompt tokens the server says
came from its cache.

The request list comes from `workloads` (seeded), the load from `serve_client`, the arithmetic
from `serve_metrics`; this module is the CLI face: options, the rate sweep, the table, the JSON
and the plot. Each rate of a sweep runs the same list; with `--baseline-url` each rate runs on
ours, then on the baseline. By default every run puts its own short tag in front of every
prompt, so a rate does not find the prefixes of the rate before it in the cache (`--no-salt`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import click
from pydantic import Field, PositiveInt, field_validator

from kvpool.tools.bench.report import Report, Result, progress, ratio
from kvpool.tools.bench.serve_client import ServeResult, first_model, rate_json, run_serve_bench
from kvpool.tools.bench.serve_metrics import parse_slo
from kvpool.tools.bench.workloads import Request, chat_requests, docqa_requests, random_requests, trace_requests
from kvpool.tools.workload_file import WorkloadFile, list_of, takes_workload

__all__ = ["serve", "run_serve_bench", "ServeResult", "ServeWorkload", "build_workload"]

STATS = ("mean", "median", "p90", "p99")
LATENCIES = ("ttft", "tpot", "itl", "e2e")
SCALARS = (("request_throughput", "req/s"), ("output_throughput", "tok/s"), ("total_token_throughput", "tok/s"),
           ("goodput", "req/s"), ("completed", "requests"), ("failed", "requests"),
           ("mean_cached_tokens", "tokens"))


@dataclass
class ServeCase(Result):
    """A `report.Result` for one arrival rate."""

    rate: float | str | None = None


@dataclass
class Target:
    label: str
    base_url: str
    model: str


class ServeWorkload(WorkloadFile):
    """`kvpool bench serve`'s workload keys; the defaults are a run without `--workload`."""

    PATH_KEYS = ("trace",)

    kind: Literal["random", "chat", "docqa", "trace"] = Field("random", description="Which request list.")
    num_requests: PositiveInt | None = Field(None, description="Requests per run (random: 100; chat/docqa: "
                                             "every conversation/document, their count derived from this).")
    seed: int = 0
    input_len: PositiveInt = Field(256, description="random: prompt words.")
    output_len: PositiveInt = Field(64, description="random/chat/docqa: max_tokens per request.")
    range_ratio: float = Field(0.0, ge=0, lt=1, description="random: lengths uniform in len*(1±ratio).")
    conversations: PositiveInt | None = Field(None, description="chat: conversations (8, or from num_requests).")
    rounds: PositiveInt = Field(3, description="chat: user turns each.")
    system_prompts: PositiveInt = Field(2, description="chat: shared system prompts.")
    system_len: PositiveInt = Field(512, description="chat: system prompt words.")
    turn_len: PositiveInt = Field(48, description="chat: user turn words.")
    documents: PositiveInt | None = Field(None, description="docqa: documents (4, or from num_requests).")
    doc_len: PositiveInt = Field(1024, description="docqa: document words.")
    questions: PositiveInt = Field(4, description="docqa: questions each.")
    trace: str | None = Field(None, description="trace: a Mooncake JSONL trace.")
    trace_limit: PositiveInt | None = Field(None, description="trace: its first N requests.")
    block_words: PositiveInt = Field(32, description="trace: words per 512-token hash block.")
    output_scale: float | None = Field(None, gt=0, description="trace: output length factor (default: "
                                       "block_words/512, the input's scale).")
    max_output: PositiveInt = Field(64, description="trace: output cap.")
    rate: list_of(float) = Field([math.inf], description="Poisson arrivals per second; inf: all at once; "
                                 "several sweep.")
    arrival: Literal["poisson", "trace"] = Field("poisson", description="trace: the trace's timestamps "
                                                 "(times time_scale) instead of rate.")
    time_scale: float = Field(1.0, ge=0, description="trace arrival: multiply the gaps (0.5: twice as fast).")
    max_concurrency: PositiveInt | None = Field(None, description="Bound on requests in flight.")
    warmup: int = Field(2, ge=0, description="Requests sent to each endpoint first (other text; not counted).")
    goodput: list_of(str) = Field([], description="SLOs for goodput, e.g. [\"ttft:2000\", \"tpot:100\"] "
                                  "(ttft, tpot or e2e, ms).")
    temperature: float = 0.0
    extra_body: dict[str, Any] | None = Field(None, description="Merged into every request body, e.g. "
                                              "{ignore_eos = true}.")
    request_timeout: float = Field(600.0, ge=1, description="Seconds before a silent request fails.")
    salt: bool = Field(True, description="Tag each run's prompts so a run does not reuse the cache of the run "
                       "before.")

    @field_validator("rate")
    @classmethod
    def _positive_rates(cls, rates: list[float]) -> list[float]:
        if not rates or any(r <= 0 or math.isnan(r) for r in rates):
            raise ValueError("rates must be positive numbers or inf")
        return rates


def build_workload(w: ServeWorkload, seed: int, num_requests: int | None = None) -> list[Request]:
    """The request list of `w` (cut to `num_requests`, by default the workload's, when set)."""
    n = w.num_requests if num_requests is None else num_requests
    if w.kind == "random":
        reqs = random_requests(n or 100, w.input_len, w.output_len, w.range_ratio, seed)
    elif w.kind == "chat":
        conversations = w.conversations or (math.ceil(n / w.rounds) if n else 8)
        reqs = chat_requests(conversations, w.rounds, w.system_prompts, w.system_len, w.turn_len, w.output_len, seed)
    elif w.kind == "docqa":
        documents = w.documents or (math.ceil(n / w.questions) if n else 4)
        reqs = docqa_requests(documents, w.doc_len, w.questions, w.output_len, seed)
    else:
        if not w.trace:
            raise click.UsageError("a trace workload needs its file: --trace PATH")
        reqs = trace_requests(w.trace, limit=w.trace_limit or n, block_words=w.block_words,
                              output_scale=w.output_scale, max_output=w.max_output, seed=seed)
    return reqs[:n] if n else reqs


def _discover(base_url: str, api_key: str | None) -> str:
    import httpx

    async def go() -> str:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        async with httpx.AsyncClient(timeout=30.0, headers=headers, trust_env=False) as client:
            return await first_model(client, base_url)

    return asyncio.run(go())


@takes_workload("bench serve", ServeWorkload)
@click.command()
@click.option("--base-url", help="The endpoint under test, e.g. http://127.0.0.1:8000/v1 (required).")
@click.option("--model", help="Model name (default: the first of GET /v1/models).")
@click.option("--label", default="ours", show_default=True, help="Name of this endpoint in the JSON and the plot.")
@click.option("--baseline-url", help="A second endpoint measured in the same run (ours, baseline per rate).")
@click.option("--baseline-model", help="Its model name (default: the first of its /models).")
@click.option("--baseline-label", default="baseline", show_default=True)
@click.option("--api-key", envvar="OPENAI_API_KEY", help="Bearer token for both endpoints (env OPENAI_API_KEY).")
@click.option("--endpoint", type=click.Choice(["chat", "completions"]), default="chat", show_default=True)
@click.option("--num-requests", type=click.IntRange(min=1), help="Requests per run (key num_requests).")
@click.option("--rate", help="Arrivals per second, inf: all at once; a list (0.5,1,2) sweeps (key rate).")
@click.option("--seed", type=int, help="Seed of the request list and the arrivals (key seed).")
@click.option("--trace", type=click.Path(dir_okay=False, exists=True), help="A Mooncake JSONL trace (key trace).")
@click.option("--per-request", is_flag=True, help="Put every request's record in the JSON runs.")
@click.option("--output-dir", type=click.Path(file_okay=False), help="Write serve-LABEL.json and serve-LABEL.png here.")
@click.option("--json", "as_json", is_flag=True, help="End with one JSON line.")
@click.pass_context
def serve(ctx: click.Context, workload: ServeWorkload, **opts: Any) -> None:
    """Load an OpenAI-compatible endpoint; TTFT/TPOT/ITL/E2E, throughput and goodput per rate.

    \b
    kvpool bench serve --base-url http://127.0.0.1:8000/v1 --workload chat --rate 0.5,1,2
    kvpool bench serve --base-url URL --workload chat-trace --trace conversation_trace.jsonl
    kvpool bench serve --base-url URL --workload my-load.toml --set output_len=16 --json
    """
    w = workload
    for noisy in ("httpx", "matplotlib"):  # a line per request / per font is noise here
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if not opts["base_url"]:
        raise click.UsageError("Missing option '--base-url'.")
    rates: list[float | str] = ["trace"] if w.arrival == "trace" else list(w.rate)
    if w.arrival == "trace" and w.kind != "trace":
        raise click.UsageError("arrival = \"trace\" needs kind = \"trace\"")
    try:
        slos = dict(parse_slo(s) for s in w.goodput)
    except ValueError as exc:
        raise click.UsageError(f"goodput: {exc}") from None
    try:
        requests = build_workload(w, w.seed)
        warmup = build_workload(w, w.seed + 1, num_requests=w.warmup) if w.warmup else []
    except (OSError, ValueError) as exc:
        raise click.UsageError(f"workload: {exc}") from None

    targets = [Target(opts["label"], opts["base_url"], opts["model"] or _discover(opts["base_url"], opts["api_key"]))]
    if opts["baseline_url"]:
        targets.append(Target(opts["baseline_label"], opts["baseline_url"],
                              opts["baseline_model"] or _discover(opts["baseline_url"], opts["api_key"])))
    common = dict(endpoint=opts["endpoint"], max_concurrency=w.max_concurrency, time_scale=w.time_scale,
                  seed=w.seed, temperature=w.temperature, slos_ms=slos, extra_body=w.extra_body,
                  api_key=opts["api_key"], timeout_s=w.request_timeout)

    def run(target: Target, reqs: list[Request], rate: float | str, what: str) -> ServeResult:
        bar, advance = progress(len(reqs), f"{what} {target.label} @ {rate_json(rate)}")
        with bar:
            return run_serve_bench(target.base_url, reqs, rate, model=target.model, label=target.label,
                                   on_done=advance, **common)

    if warmup:
        for target in targets:
            run(target, [r.salted("Warmup. ") for r in warmup], math.inf, "warm-up")
    runs: list[ServeResult] = []
    for i, rate in enumerate(rates):
        reqs = [r.salted(f"Run {i}. ") for r in requests] if w.salt else requests
        for target in targets:
            runs.append(run(target, reqs, rate, "serve"))

    config = {k: v for k, v in opts.items() if k not in ("api_key", "as_json")}
    config.update({k: v for k, v in w.settings().items() if k != "rate"}, workload=w.source or w.kind,
                  rates=[rate_json(r) for r in rates], goodput=slos,
                  num_requests=len(requests), models={t.label: t.model for t in targets})
    report = build_report(runs, targets)
    doc = {**report.document(), "label": opts["label"], "config": config,
           "runs": [r.to_json(opts["per_request"]) for r in runs]}
    doc["notes"] = report.notes
    if opts["output_dir"]:
        out = Path(opts["output_dir"])
        out.mkdir(parents=True, exist_ok=True)
        stem = out / f"serve-{_safe(opts['label'])}"
        stem.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
        report.notes.append(f"wrote {stem.with_suffix('.json')}")
        report.notes.append(plot(runs, stem.with_suffix(".png"), f"kvpool bench serve: {w.source or w.kind}"))
    emit(report, runs, targets, doc, opts["as_json"])


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "run"


def build_report(runs: list[ServeResult], targets: list[Target]) -> Report:
    """One `ServeCase` per (rate, metric) for ours; the baseline's run at the same rate fills
    baseline/baseline_value/ratio. Latency spreads are that metric's [p50, p99]."""
    report = Report("serve")
    ours = [r for r in runs if r.label == targets[0].label]
    base = {str(r.rate): r for r in runs if len(targets) > 1 and r.label == targets[1].label}
    for run in ours:
        mine, theirs = run.metrics.flat(), (base[str(run.rate)].metrics.flat() if str(run.rate) in base else None)
        cases = [(f"{m}_{s}", "ms", [mine[f"{m}_median"], mine[f"{m}_p99"]]) for m in LATENCIES for s in STATS]
        cases.insert(4, ("ttft_std", "ms", [mine["ttft_median"], mine["ttft_p99"]]))
        cases += [(name, unit, None) for name, unit in SCALARS if mine.get(name) is not None]
        for case, unit, spread in cases:
            value = mine[case]
            base_value = theirs.get(case) if theirs else None
            report.results.append(ServeCase(
                case=case, value=value, unit=unit, rate=rate_json(run.rate),
                baseline=targets[1].label if theirs else None, baseline_value=base_value,
                ratio=None if case == "failed" else ratio(value, base_value, unit),
                spread=spread or [value, value]))
    for run in runs:
        if run.metrics.failed:
            report.notes.append(f"{run.label} @ {rate_json(run.rate)}: {run.metrics.failed} of "
                                f"{run.metrics.failed + run.metrics.completed} failed; " + "; ".join(run.metrics.errors))
    return report


def emit(report: Report, runs: list[ServeResult], targets: list[Target], doc: dict[str, Any], as_json: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    has_base = len(targets) > 1
    table = Table(title="kvpool bench serve")
    for col in ("rate", "metric", "unit", targets[0].label, *((targets[1].label, "ratio") if has_base else ())):
        table.add_column(col, justify="left" if col in ("rate", "metric", "unit") else "right", no_wrap=True)
    last_rate = None
    for r in report.results:
        if last_rate is not None and r.rate != last_rate:
            table.add_section()
        last_rate = r.rate
        row = [str(r.rate), r.case, r.unit, f"{r.value:g}"]
        if has_base:
            row += ["-" if r.baseline_value is None else f"{r.baseline_value:g}", "-" if r.ratio is None else f"{r.ratio:.2f}"]
        table.add_row(*row)
    Console(file=sys.stderr if as_json else sys.stdout).print(table)
    for note in report.notes:
        print(f"note: {note}", file=sys.stderr if as_json else sys.stdout)
    if as_json:
        sys.stdout.write(json.dumps(doc) + "\n")
        sys.stdout.flush()


def plot(runs: list[ServeResult], path: Path, title: str) -> str:
    """TTFT p50/p99, TPOT p50/p99, E2E p99 and throughputs against rate, a line per endpoint."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(dict.fromkeys(str(rate_json(r.rate)) for r in runs))
    panels = [("TTFT (ms)", [("ttft_median", "p50", "-"), ("ttft_p99", "p99", "--")]),
              ("TPOT (ms)", [("tpot_median", "p50", "-"), ("tpot_p99", "p99", "--")]),
              ("E2E p99 (ms)", [("e2e_p99", "p99", "-")]),
              ("output throughput (tok/s)", [("output_throughput", "", "-")]),
              ("request throughput (req/s)", [("request_throughput", "", "-")])]
    if any(r.metrics.goodput is not None for r in runs):
        panels.append(("goodput (req/s)", [("goodput", "", "-")]))
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (name, series) in zip(axes.flat, panels):
        for n, label in enumerate(dict.fromkeys(r.label for r in runs)):
            mine = {str(rate_json(r.rate)): r.metrics.flat() for r in runs if r.label == label}
            xs = [i for i, rate in enumerate(rates) if rate in mine]
            for key, stat, style in series:
                ys = [mine[rates[i]][key] for i in xs]
                ax.plot(xs, ys, style, marker="o", color=f"C{n}", label=f"{label} {stat}".strip())
        ax.set_title(name)
        ax.set_xticks(range(len(rates)), rates)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"wrote {path}"
