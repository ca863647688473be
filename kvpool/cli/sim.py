"""`kvpool sim`: simulate a cluster on a trace; `kvpool sim plan`: the capacity planner;
`kvpool sim calibrate`: measure this machine's reference workers into the `local` profile."""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import click



def _size_or_unlimited(value: str | None) -> int | None:
    from kvpool.config import parse_size

    if value is None or value.strip().lower() in ("unlimited", "inf", "none"):
        return None
    return parse_size(value)


def _workload_options(fn):
    opts = [
        click.option("--trace", type=click.Path(dir_okay=False), help="Mooncake-format JSONL trace."),
        click.option("--synthetic", type=int, metavar="N", help="N synthetic multi-turn chat requests instead."),
        click.option("--synthetic-rate", type=float, default=2.0, show_default=True, help="Their arrival rate."),
        click.option("--limit", type=int, help="Only the first N requests of the trace."),
        click.option("--rate-scale", type=float, default=1.0, show_default=True,
                     help="Replay the arrivals this many times as fast (2: twice the rate)."),
        click.option("--profile", "profile_name", default="h100-llama3-8b", show_default=True,
                     help="Performance profile: 'local' (kvpool sim calibrate), a GPU profile, or a JSON file."),
        click.option("--decode-profile", help="Another profile for decode instances (other cards)."),
        click.option("--price", type=float, help="$ per instance-hour (overrides the profile's)."),
        click.option("--decode-price", type=float, help="$ per decode-instance-hour."),
        click.option("--policy", default="cache_aware", show_default=True,
                     type=click.Choice(["cache_aware", "round_robin", "least_loaded"])),
        click.option("--eviction", default="lru", show_default=True, type=click.Choice(["lru", "s3fifo", "arc"])),
        click.option("--cache", default="global", show_default=True, type=click.Choice(["global", "local"]),
                     help="global: one pool for all; local: each prefilling instance its own share."),
        click.option("--ssd", default="0", show_default=True, help="Pool SSD in total (e.g. 4TiB)."),
        click.option("--local-prefill-tokens", type=int, default=256, show_default=True,
                     help="Uncached work this small is prefilled on the decode instance (router default)."),
        click.option("--host-cores", type=int, default=0, show_default=True,
                     help="Instances share this many CPU cores (one host, e.g. the local profile); 0: dedicated."),
        click.option("--slo-ttft-ms", type=float, default=2000.0, show_default=True),
        click.option("--slo-tbt-ms", type=float, default=100.0, show_default=True, help="TPOT SLO per request."),
        click.option("--slo-target", type=float, default=0.9, show_default=True,
                     help="Fraction of requests that must meet both SLOs (goodput, plan)."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def _load(opts: dict[str, Any]):
    from kvpool.tools.sim.profile import load_profile
    from kvpool.tools.sim.workload import load_trace, synthetic

    if opts["trace"] and opts["synthetic"]:
        raise click.UsageError("give --trace FILE or --synthetic N, not both")
    if opts["trace"]:
        workload = load_trace(opts["trace"], limit=opts["limit"])
    elif opts["synthetic"]:
        workload = synthetic(opts["synthetic"], opts["synthetic_rate"])
    else:
        raise click.UsageError("give a workload: --trace FILE (Mooncake JSONL) or --synthetic N")
    workload = workload.scaled(opts["rate_scale"])
    prof = load_profile(opts["profile_name"]).with_price(opts["price"])
    dprof = load_profile(opts["decode_profile"]).with_price(opts["decode_price"]) if opts["decode_profile"] else (
        None if opts["decode_price"] is None else prof.with_price(opts["decode_price"]))
    return workload, prof, dprof


def _config(opts: dict[str, Any], prof, dprof, **over):
    from kvpool.config import parse_size
    from kvpool.tools.sim.engine import SimConfig

    cfg = SimConfig(profile=prof, decode_profile=dprof, ssd_bytes=parse_size(opts["ssd"]), eviction=opts["eviction"],
                    policy=opts["policy"], cache=opts["cache"], local_prefill_tokens=opts["local_prefill_tokens"],
                    host_cores=opts["host_cores"])
    return replace(cfg, **over)


@click.group(invoke_without_command=True)
@_workload_options
@click.option("--prefill", type=int, default=0, help="Prefill instances.")
@click.option("--decode", type=int, default=0, help="Decode instances.")
@click.option("--colocated", type=int, default=0, help="Colocated instances (instead of --prefill/--decode).")
@click.option("--dram", default="unlimited", show_default=True, help="Pool DRAM in total (e.g. 512GiB) or unlimited.")
@click.option("--goodput-steps", type=int, default=6, show_default=True,
              help="Extra runs of the rate search for goodput_rps (0: skip, goodput_rps null).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write PNG plots here.")
@click.option("--kv-codec", default="none", show_default=True, metavar="CODEC",
              help="Pool chunks stored with this codec (kvpool.codec): every block, fetch and push shrinks by "
                   "its bytes ratio (e.g. int8: 0.51 of bf16); decode cost not modelled.")
@click.option("--json", "as_json", is_flag=True, help="End the output with one JSON line.")
@click.pass_context
def sim(ctx: click.Context, prefill, decode, colocated, dram, goodput_steps, plot_path, kv_codec, as_json,
        **opts) -> None:
    """Simulate a serving cluster on a trace, with the real router and eviction policies.

    \b
    kvpool sim --trace conversation_trace.jsonl --prefill 16 --decode 16 --json
    kvpool sim --trace T --colocated 32 --dram 1TiB --ssd 8TiB --policy round_robin
    kvpool sim plan --trace T --mix 8P/24D,16P/16D,32c --dram 256GiB,1TiB --plot plan.png
    kvpool sim calibrate            (measures this machine's workers: the 'local' profile)

    Profiles: local, h100-llama3-8b, a100-llama3-8b, h200-llama3-8b, l40s-llama3-8b,
    h100x8-llama3-70b, a100x8-llama3-70b, h200x8-llama3-70b (docs/sim.md).
    """
    if ctx.invoked_subcommand is not None:
        return
    from kvpool.tools.sim.engine import Simulation
    from kvpool.tools.sim.goodput import goodput_search
    from kvpool.tools.sim.results import summarize

    if not (prefill or decode or colocated):
        raise click.UsageError("give --prefill N --decode M, or --colocated K")
    workload, prof, dprof = _load(opts)
    ratio = _codec_bytes_ratio(kv_codec, prof, workload.block_tokens)
    if ratio != 1.0:
        prof = replace(prof, bytes_per_token=max(1, round(prof.bytes_per_token * ratio)))
        dprof = None if dprof is None else replace(dprof, bytes_per_token=max(1, round(dprof.bytes_per_token * ratio)))
    cfg = _config(opts, prof, dprof, prefill=prefill, decode=decode, colocated=colocated,
                  dram_bytes=_size_or_unlimited(dram))
    slo = (opts["slo_ttft_ms"] / 1e3, opts["slo_tbt_ms"] / 1e3, opts["slo_target"])
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


@sim.command()
@_workload_options
@click.option("--mix", "mixes", default="4P/12D,8P/8D,12P/4D,16c", show_default=True,
              help="Instance mixes to try, comma-separated (NP/MD or Kc).")
@click.option("--dram", "drams", default="64GiB,256GiB,1TiB,unlimited", show_default=True,
              help="Pool DRAM sizes to try, comma-separated.")
@click.option("--dram-price", type=float, default=0.004, show_default=True, help="$ per GB-hour of pool DRAM.")
@click.option("--min-hit-ratio", type=float, default=0.0, show_default=True)
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write the curves as a PNG here.")
@click.option("--json", "as_json", is_flag=True)
def plan(mixes, drams, dram_price, min_hit_ratio, plot_path, as_json, **opts) -> None:
    """Sweep capacities and instance mixes; print the cheapest configuration meeting the targets."""
    from kvpool.tools.bench.report import progress
    from kvpool.tools.sim.plan import cheapest, sweep

    workload, prof, dprof = _load(opts)
    mix_list = [m for m in mixes.split(",") if m.strip()]
    dram_list = [(d.strip(), _size_or_unlimited(d)) for d in drams.split(",") if d.strip()]
    if not mix_list or not dram_list:
        raise click.UsageError("give at least one --mix and one --dram")
    base = _config(opts, prof, dprof)
    bar, step = progress(len(mix_list) * len(dram_list), "planning")
    with bar:
        rows = sweep(workload, base, mix_list, dram_list, opts["slo_ttft_ms"] / 1e3, opts["slo_tbt_ms"] / 1e3,
                     opts["slo_target"], dram_price, on_step=step)
    best = cheapest(rows, opts["slo_target"], min_hit_ratio)
    doc = {"requests": len(workload), "offered_rps": round(workload.rate, 4), "profile": prof.name,
           "targets": {"slo_ttft_ms": opts["slo_ttft_ms"], "slo_tbt_ms": opts["slo_tbt_ms"],
                       "slo_target": opts["slo_target"], "min_hit_ratio": min_hit_ratio},
           "rows": rows, "cheapest": best}
    if plot_path:
        from kvpool.tools.sim.plot import plot_plan

        doc["plot"] = str(plot_plan(rows, best, opts["slo_target"], Path(plot_path)))
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


@sim.command()
@_workload_options
@click.option("--prefill", type=int, default=16, show_default=True)
@click.option("--decode", type=int, default=16, show_default=True)
@click.option("--cheap-decode-profile", default="a100-llama3-8b", show_default=True,
              help="Decode cards of the equal-cost disaggregated config (Splitwise).")
@click.option("--scales", default="1,4,8", show_default=True, help="Rate scales for the load rows.")
@click.option("--capacities", default="256GiB,1TiB,4TiB", show_default=True,
              help="Pool DRAM sizes for global vs local caches.")
@click.option("--goodput-steps", type=int, default=6, show_default=True)
@click.option("--out", "out_path", type=click.Path(dir_okay=False), required=True, help="JSON document here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="PNG here.")
def study(prefill, decode, cheap_decode_profile, scales, capacities, goodput_steps, out_path, plot_path,
          **opts) -> None:
    """The issue's questions on one trace: reuse bound, global vs local caches, policies, colocated vs
    disaggregated at equal count and equal cost. Writes one JSON document (and a PNG)."""
    import time

    from kvpool.tools.bench.report import progress
    from kvpool.tools.sim.profile import load_profile
    from kvpool.tools.sim.study import Study

    workload, prof, dprof = _load(opts)
    slo = (opts["slo_ttft_ms"] / 1e3, opts["slo_tbt_ms"] / 1e3, opts["slo_target"])
    scale_list = tuple(float(x) for x in scales.split(","))
    caps = [(c.strip(), _size_or_unlimited(c)) for c in capacities.split(",")]
    base = _config(opts, prof, dprof, prefill=prefill, decode=decode)
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
