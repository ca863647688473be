"""`kvpool sim`: simulate a cluster on a trace; `kvpool sim plan`: the capacity planner;
`kvpool sim calibrate`: measure this machine's reference workers into the `local` profile."""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import click
from pydantic import Field, PositiveFloat, PositiveInt

from kvpool.tools.workload_file import Size, WorkloadFile, list_of, takes_workload


def _size_or_unlimited(value: str | None) -> int | None:
    from kvpool.config import parse_size

    if value is None or value.strip().lower() in ("unlimited", "inf", "none"):
        return None
    return parse_size(value)


class SimWorkload(WorkloadFile):
    """The keys every `kvpool sim` command takes: the workload, the cards, the routing and the
    pool, the SLOs. The presets (kvpool/tools/presets/sim) hold only these."""

    PATH_KEYS = ("trace",)

    trace: str | None = Field(None, description="Mooncake-format JSONL trace.")
    synthetic: PositiveInt | None = Field(None, description="N synthetic multi-turn chat requests instead.")
    synthetic_rate: PositiveFloat = Field(2.0, description="Their arrival rate.")
    limit: PositiveInt | None = Field(None, description="Only the first N requests of the trace.")
    rate_scale: PositiveFloat = Field(1.0, description="Replay the arrivals this many times as fast.")
    profile: str = Field("h100-llama3-8b", description="Performance profile: local (kvpool sim calibrate), a GPU "
                         "profile, or a JSON file.")
    decode_profile: str | None = Field(None, description="Another profile for decode instances (other cards).")
    price: float | None = Field(None, ge=0, description="$ per instance-hour (overrides the profile's).")
    decode_price: float | None = Field(None, ge=0, description="$ per decode-instance-hour.")
    policy: Literal["cache_aware", "round_robin", "least_loaded"] = "cache_aware"
    eviction: Literal["lru", "s3fifo", "arc"] = "lru"
    cache: Literal["global", "local"] = Field("global", description="global: one pool for all; local: each "
                                              "prefilling instance its own share.")
    ssd: Size = Field("0", description="Pool SSD in total (e.g. 4TiB).")
    local_prefill_tokens: int = Field(256, ge=0, description="Uncached work this small is prefilled on the decode "
                                      "instance (router default).")
    host_cores: int = Field(0, ge=0, description="Instances share this many CPU cores (one host, e.g. the local "
                            "profile); 0: dedicated.")
    slo_ttft_ms: PositiveFloat = 2000.0
    slo_tbt_ms: PositiveFloat = Field(100.0, description="TPOT SLO per request.")
    slo_target: float = Field(0.9, ge=0, le=1, description="Fraction of requests that must meet both SLOs.")


class RunWorkload(SimWorkload):
    prefill: int = Field(0, ge=0, description="Prefill instances.")
    decode: int = Field(0, ge=0, description="Decode instances.")
    colocated: int = Field(0, ge=0, description="Colocated instances (instead of prefill/decode).")
    dram: Size = Field("unlimited", description="Pool DRAM in total (e.g. 512GiB) or unlimited.")
    goodput_steps: int = Field(6, ge=0, description="Extra runs of the rate search for goodput_rps (0: skip).")
    kv_codec: str = Field("none", description="Pool chunks stored with this codec (kvpool.codec): every block, fetch "
                          "and push shrinks by its bytes ratio (e.g. int8: 0.51 of bf16); decode cost not modelled.")


class PlanWorkload(SimWorkload):
    mix: list_of(str) = Field(["4P/12D", "8P/8D", "12P/4D", "16c"], description="Instance mixes to try (NP/MD or Kc).")
    dram: list_of(Size) = Field(["64GiB", "256GiB", "1TiB", "unlimited"], description="Pool DRAM sizes to try.")
    dram_price: float = Field(0.004, ge=0, description="$ per GB-hour of pool DRAM.")
    min_hit_ratio: float = Field(0.0, ge=0, le=1)


class StudyWorkload(SimWorkload):
    prefill: PositiveInt = 16
    decode: PositiveInt = 16
    cheap_decode_profile: str = Field("a100-llama3-8b", description="Decode cards of the equal-cost disaggregated "
                                      "config (Splitwise).")
    scales: list_of(PositiveFloat) = Field([1.0, 4.0, 8.0], description="Rate scales for the load rows.")
    capacities: list_of(Size) = Field(["256GiB", "1TiB", "4TiB"], description="Pool DRAM sizes for global vs local "
                                      "caches.")
    goodput_steps: int = Field(6, ge=0)


def _common_flags(fn):
    """The flags every sim command keeps: they override the workload's keys of their names."""
    for opt in reversed([
        click.option("--trace", help="Mooncake-format JSONL trace (key trace)."),
        click.option("--rate-scale", type=float, help="Replay the arrivals this many times as fast (key rate_scale)."),
        click.option("--profile", help="Performance profile: local, a GPU profile or a JSON file (key profile)."),
    ]):
        fn = opt(fn)
    return fn


def _load(w: SimWorkload):
    from kvpool.tools.sim.profile import load_profile
    from kvpool.tools.sim.workload import load_trace, synthetic

    if w.trace and w.synthetic:
        raise click.UsageError("give a trace (--trace FILE) or synthetic = N, not both")
    if w.trace:
        workload = load_trace(w.trace, limit=w.limit)
    elif w.synthetic:
        workload = synthetic(w.synthetic, w.synthetic_rate)
    else:
        raise click.UsageError("give a workload: --trace FILE (Mooncake JSONL), or a preset or file with "
                               "synthetic = N (e.g. --workload synthetic-chat)")
    workload = workload.scaled(w.rate_scale)
    prof = load_profile(w.profile).with_price(w.price)
    dprof = load_profile(w.decode_profile).with_price(w.decode_price) if w.decode_profile else (
        None if w.decode_price is None else prof.with_price(w.decode_price))
    return workload, prof, dprof


def _config(w: SimWorkload, prof, dprof, **over):
    from kvpool.config import parse_size
    from kvpool.tools.sim.engine import SimConfig

    cfg = SimConfig(profile=prof, decode_profile=dprof, ssd_bytes=parse_size(w.ssd), eviction=w.eviction,
                    policy=w.policy, cache=w.cache, local_prefill_tokens=w.local_prefill_tokens,
                    host_cores=w.host_cores)
    return replace(cfg, **over)


@takes_workload("sim", RunWorkload)
@click.group(invoke_without_command=True)
@_common_flags
@click.option("--prefill", type=click.IntRange(min=0), help="Prefill instances (key prefill).")
@click.option("--decode", type=click.IntRange(min=0), help="Decode instances (key decode).")
@click.option("--colocated", type=click.IntRange(min=0), help="Colocated instances, instead (key colocated).")
@click.option("--dram", help="Pool DRAM in total (e.g. 512GiB) or unlimited (key dram).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write PNG plots here.")
@click.option("--json", "as_json", is_flag=True, help="End the output with one JSON line.")
@click.pass_context
def sim(ctx: click.Context, workload: RunWorkload | None, plot_path, as_json) -> None:
    """Simulate a serving cluster on a trace, with the real router and eviction policies.

    \b
    kvpool sim --trace conversation_trace.jsonl --prefill 16 --decode 16 --json
    kvpool sim --trace T --colocated 32 --dram 1TiB --set ssd=8TiB --set policy=round_robin
    kvpool sim --workload synthetic-chat --prefill 4 --decode 4 --json
    kvpool sim plan --trace T --mix 8P/24D,16P/16D,32c --dram 256GiB,1TiB --plot plan.png
    kvpool sim calibrate            (measures this machine's workers: the 'local' profile)

    Profiles: local, h100-llama3-8b, a100-llama3-8b, h200-llama3-8b, l40s-llama3-8b,
    h100x8-llama3-70b, a100x8-llama3-70b, h200x8-llama3-70b (docs/sim.md).
    """
    if ctx.invoked_subcommand is not None or workload is None:
        return
    from kvpool.tools.sim.engine import Simulation
    from kvpool.tools.sim.goodput import goodput_search
    from kvpool.tools.sim.results import summarize

    w = workload
    goodput_steps, kv_codec = w.goodput_steps, w.kv_codec
    if not (w.prefill or w.decode or w.colocated):
        raise click.UsageError("give --prefill N --decode M, or --colocated K")
    workload, prof, dprof = _load(w)
    ratio = _codec_bytes_ratio(kv_codec, prof, workload.block_tokens)
    if ratio != 1.0:
        prof = replace(prof, bytes_per_token=max(1, round(prof.bytes_per_token * ratio)))
        dprof = None if dprof is None else replace(dprof, bytes_per_token=max(1, round(dprof.bytes_per_token * ratio)))
    cfg = _config(w, prof, dprof, prefill=w.prefill, decode=w.decode, colocated=w.colocated,
                  dram_bytes=_size_or_unlimited(w.dram))
    slo = (w.slo_ttft_ms / 1e3, w.slo_tbt_ms / 1e3, w.slo_target)
    from kvpool.tools.bench.report import progress

    bar, step = progress(len(workload) + goodput_steps, f"simulating {len(workload)} requests")
    with bar:
        simulation = Simulation(workload, cfg).run(on_progress=lambda n: bar.advance(bar.task_ids[0], n))
        summary = summarize(simulation, *slo)
        runs = lambda scale: summarize(Simulation(workload.scaled(scale), cfg).run(), *slo)  # noqa: E731
        goodput, points = goodput_search(runs, workload.rate, slo[2], first=summary, steps=goodput_steps,
                                         on_step=step)
    summary["kv_codec"], summary["kv_bytes_ratio"] = kv_codec, round(ratio, 4)
    summary["goodput_rps"] = None if goodput is None else round(goodput, 5)
    summary["goodput_search"] = points
    if plot_path:
        from kvpool.tools.sim.plot import plot_run

        summary["plot"] = str(plot_run(simulation, summary, points, Path(plot_path)))
    _emit(summary, as_json)


def _codec_bytes_ratio(codec: str, prof, block_tokens: int) -> float:
    """Pool bytes per token with `codec` over the profile's own (the KV's dtype): the GPU profiles
    hold bf16 KV of head dim 128 (Llama 3), `local` the reference model's float32, head dim 64."""
    from kvpool.chunk_format import KVLayout
    from kvpool.codec import get_codec, stored_bytes_per_token

    get_codec(codec)  # an unknown name is InvalidArgument
    if codec == "none":
        return 1.0
    dtype, head_dim = ("float32", 64) if prof.name == "local" else ("bfloat16", 128)
    layout = KVLayout(1, 1, head_dim, dtype, block_tokens, codec)
    return stored_bytes_per_token(layout) / layout.bytes_per_token


def _emit(summary: dict[str, Any], as_json: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="kvpool sim", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in ("requests", "completed", "rejected", "hit_ratio", "token_hit_ratio", "slo_attainment",
                "goodput_rps", "attained_rps"):
        if key in summary:
            table.add_row(key, str(summary[key]))
    for key in ("ttft_ms", "tbt_ms", "tpot_ms"):
        if key in summary:
            d = summary[key]
            table.add_row(key, " ".join(f"{k} {v}" for k, v in d.items() if k in ("mean", "p50", "p99")))
    for key in ("busy", "throughput", "cost", "reuse_upper_bound"):
        if key in summary:
            table.add_row(key, json.dumps(summary[key]))
    if "sim_wall_s" in summary:
        table.add_row("simulation wall time", f"{summary['sim_wall_s']} s")
    Console(file=sys.stdout if not as_json else sys.stderr).print(table)
    if as_json:
        click.echo(json.dumps(summary, default=_json_default))


def _json_default(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return str(obj)


@takes_workload("sim plan", PlanWorkload, presets="sim")
@sim.command()
@_common_flags
@click.option("--mix", help="Instance mixes to try, comma-separated: NP/MD or Kc (key mix).")
@click.option("--dram", help="Pool DRAM sizes to try, comma-separated (key dram).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write the curves as a PNG here.")
@click.option("--json", "as_json", is_flag=True)
def plan(workload: PlanWorkload, plot_path, as_json) -> None:
    """Sweep capacities and instance mixes; print the cheapest configuration meeting the targets."""
    from kvpool.tools.bench.report import progress
    from kvpool.tools.sim.plan import cheapest, sweep

    w = workload
    dram_price, min_hit_ratio = w.dram_price, w.min_hit_ratio
    workload, prof, dprof = _load(w)
    mix_list = list(w.mix)
    dram_list = [(d.strip(), _size_or_unlimited(d)) for d in w.dram]
    if not mix_list or not dram_list:
        raise click.UsageError("give at least one --mix and one --dram")
    base = _config(w, prof, dprof)
    bar, step = progress(len(mix_list) * len(dram_list), "planning")
    with bar:
        rows = sweep(workload, base, mix_list, dram_list, w.slo_ttft_ms / 1e3, w.slo_tbt_ms / 1e3, w.slo_target,
                     dram_price, on_step=step)
    best = cheapest(rows, w.slo_target, min_hit_ratio)
    doc = {"requests": len(workload), "offered_rps": round(workload.rate, 4), "profile": prof.name,
           "targets": {"slo_ttft_ms": w.slo_ttft_ms, "slo_tbt_ms": w.slo_tbt_ms,
                       "slo_target": w.slo_target, "min_hit_ratio": min_hit_ratio},
           "rows": rows, "cheapest": best}
    if plot_path:
        from kvpool.tools.sim.plot import plot_plan

        doc["plot"] = str(plot_plan(rows, best, w.slo_target, Path(plot_path)))
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvpool sim plan ({len(workload)} requests at {workload.rate:.3g} req/s, {prof.name})")
    for col in ("mix", "dram", "$/h", "attainment", "hit ratio", "TTFT p99 ms", "TBT p99 ms"):
        table.add_column(col)
    for r in rows:
        mark = " *" if best is r else ""
        table.add_row(r["mix"] + mark, r["dram"], f"{r['cost_per_hour']:.2f}", f"{r['slo_attainment']:.3f}",
                      f"{r['hit_ratio']:.3f}", f"{r['ttft_p99_ms']}", f"{r['tbt_p99_ms']}")
    console = Console(file=sys.stderr if as_json else sys.stdout)
    console.print(table)
    console.print(f"cheapest meeting the targets: {best['mix']} with {best['dram']} DRAM at ${best['cost_per_hour']:.2f}/h"
                  if best else "no configuration tried meets the targets: add instances or relax the SLOs")
    if as_json:
        click.echo(json.dumps(doc, default=_json_default))


@sim.command()
@click.option("--out", "out_path", type=click.Path(dir_okay=False),
              help="Where to write the profile (default: the 'local' profile path, ~/.cache/kvpool/tools/sim/local.json).")
@click.option("--workdir", type=click.Path(file_okay=False))
@click.option("--repeats", type=int, default=2, show_default=True, help="Measurements per prefill point (all of them fitted).")
@click.option("--json", "as_json", is_flag=True)
def calibrate(out_path, workdir, repeats, as_json) -> None:
    """Measure this machine's reference workers (prefill vs uncached/cached tokens, decode step
    vs batch size and KV, pool fetch and push rates) and write the 'local' profile."""
    import tempfile

    from kvpool.tools.launch.local import LocalCluster, WorkerSpec
    from kvpool.tools.sim.calibrate import fit, measure
    from kvpool.tools.sim.profile import local_profile_path

    path = Path(out_path) if out_path else local_profile_path()
    workdir = Path(workdir or tempfile.mkdtemp(prefix="kvpool-sim-calibrate-"))
    from reference_worker.cpus import format_list, plan as cores_for

    cores = cores_for(2, 1)  # a core each, as `kvpool bench disagg` pins its workers
    cluster = LocalCluster(workdir, [WorkerSpec("prefill", "prefill-0", ["--local-cache", "0", "--cpus", format_list(cores[0])]),
                                     WorkerSpec("decode", "decode-0", ["--local-cache", "0", "--cpus", format_list(cores[1])])]).start()
    try:
        samples, bytes_per_token = measure(cluster.url("prefill-0"), cluster.url("decode-0"), repeats=repeats)
    finally:
        cluster.stop()
    profile = fit(samples, bytes_per_token)
    profile.save(path)
    click.echo(f"local profile written to {path}", err=as_json)
    if as_json:
        click.echo(json.dumps({"profile": profile.to_json(), "path": str(path), "samples": samples}))
    else:
        click.echo(json.dumps(profile.to_json(), indent=1))


@takes_workload("sim study", StudyWorkload, presets="sim")
@sim.command()
@_common_flags
@click.option("--prefill", type=click.IntRange(min=1), help="Prefill instances (key prefill).")
@click.option("--decode", type=click.IntRange(min=1), help="Decode instances (key decode).")
@click.option("--out", "out_path", type=click.Path(dir_okay=False), help="JSON document here (required).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="PNG here.")
def study(workload: StudyWorkload, out_path, plot_path) -> None:
    """The issue's questions on one trace: reuse bound, global vs local caches, policies, colocated vs
    disaggregated at equal count and equal cost. Writes one JSON document (and a PNG)."""
    import time

    from kvpool.tools.bench.report import progress
    from kvpool.tools.sim.profile import load_profile
    from kvpool.tools.sim.study import Study

    if not out_path:
        raise click.UsageError("Missing option '--out'.")
    w = workload
    prefill, decode, cheap_decode_profile, goodput_steps = w.prefill, w.decode, w.cheap_decode_profile, w.goodput_steps
    workload, prof, dprof = _load(w)
    slo = (w.slo_ttft_ms / 1e3, w.slo_tbt_ms / 1e3, w.slo_target)
    scale_list = tuple(w.scales)
    caps = [(c.strip(), _size_or_unlimited(c)) for c in w.capacities]
    base = _config(w, prof, dprof, prefill=prefill, decode=decode)
    cheap = load_profile(cheap_decode_profile)
    n_cheap = int(decode * prof.price_per_hour // cheap.price_per_hour) if cheap.price_per_hour else decode
    configs = {f"{prefill + decode} colocated": replace(base, prefill=0, decode=0, colocated=prefill + decode),
               f"{prefill}P/{decode}D": base,
               f"{prefill}P/{decode}D conditional off": replace(base, local_prefill_tokens=0),
               f"{(prefill + decode) // 4}P/{prefill + decode - (prefill + decode) // 4}D": replace(
                   base, prefill=(prefill + decode) // 4, decode=prefill + decode - (prefill + decode) // 4),
               f"{prefill}P/{n_cheap}D-{cheap.card.split('-')[0]} (equal cost)": replace(
                   base, decode=n_cheap, decode_profile=cheap)}
    total = (len(scale_list) + 2 * len(caps) + 3 * (len(scale_list) + goodput_steps) * 2
             + len(configs) * (len(scale_list) + goodput_steps))
    bar, step = progress(total, "study")
    started = time.perf_counter()
    with bar:
        st = Study(workload, slo, goodput_steps, on_run=lambda label: step())
        doc = {"bench": "sim-study", "profile": prof.name, "cheap_decode_profile": cheap.name,
               "workload": {"name": workload.name, "requests": len(workload), "rate_rps": round(workload.rate, 4),
                            "block_tokens": workload.block_tokens},
               "slo": {"ttft_ms": slo[0] * 1e3, "tbt_ms": slo[1] * 1e3, "target": slo[2]},
               "reuse": st.reuse(base, scale_list),
               "global_vs_local": st.global_vs_local(base, [c for c in caps if c[1] is not None]),
               "policies": st.policies(base, scale_list) + st.policies(
                   replace(base, cache="local", dram_bytes=caps[0][1]), scale_list),
               "colocated_vs_disaggregated": st.colocated_vs_disaggregated(configs, scale_list)}
    doc["runs"] = st.runs
    doc["wall_s"] = round(time.perf_counter() - started, 1)
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path).write_text(json.dumps(doc, indent=1, default=_json_default) + "\n")
    if plot_path:
        from kvpool.tools.sim.plot import plot_study

        plot_study(doc, Path(plot_path))
    click.echo(f"{st.runs} simulations in {doc['wall_s']} s; written to {out_path}")


@sim.command()
@click.argument("bench_json", type=click.Path(exists=True, dir_okay=False))
@click.option("--profile", "profile_name", default="local", show_default=True, help="Profile to simulate with.")
@click.option("--host-cores", type=int, default=os.cpu_count() or 1, show_default=True,
              help="Cores the real workers shared (contention model; 0 ignores it).")
@click.option("--json", "as_json", is_flag=True)
def validate(bench_json, profile_name, host_cores, as_json) -> None:
    """Simulate a recorded `kvpool bench policies|disagg` run (BENCH_JSON) with the same workload
    and compare mean TTFT and TPOT with what the real cluster measured."""
    from transformers import AutoTokenizer

    from reference_worker.model import reference_model_path
    from kvpool.tools.sim.engine import Simulation
    from kvpool.tools.sim.profile import load_profile
    from kvpool.tools.sim.results import summarize
    from kvpool.tools.sim.validate import cases, compare

    tok = AutoTokenizer.from_pretrained(reference_model_path())

    def tokenize(messages: list[dict[str, str]]) -> list[int]:
        out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    doc = json.loads(Path(bench_json).read_text())
    rows = []
    for case in cases(doc, tokenize, load_profile(profile_name), host_cores=host_cores):
        summary = summarize(Simulation(case.workload, case.config).run(), 3600.0, 3600.0)
        rows.append(compare(case, summary))
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"simulated ({profile_name}) vs real: {Path(bench_json).name}")
    for col in ("case", "rate", "TTFT mean real", "sim", "sim/real", "TPOT mean real", "sim", "sim/real",
                "TPOT p99 real", "sim", "cached real", "sim"):
        table.add_column(col)
    for r in rows:
        real, simv, ratio = r["real"], r["sim"], r["ratio"]
        f = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
        table.add_row(r["case"], f"{r['rate']:g}", f(real["ttft_mean_ms"]), f(simv["ttft_mean_ms"]),
                      str(ratio["ttft_mean_ms"]), f(real["tpot_mean_ms"]), f(simv["tpot_mean_ms"]),
                      str(ratio["tpot_mean_ms"]), f(real["tpot_p99_ms"]), f(simv["tpot_p99_ms"]),
                      f(real["mean_cached_tokens"]), f(simv["mean_cached_tokens"]))
    Console(file=sys.stderr if as_json else sys.stdout).print(table)
    if as_json:
        click.echo(json.dumps({"bench": "sim-validate", "against": str(bench_json), "profile": profile_name,
                               "host_cores": host_cores, "rows": rows}))


__all__ = ["sim"]
