"""`kvpool up`: a local cluster of real processes (embedded pool, prefill and decode workers on
the reference model), serving until Ctrl-C. `--demo` sends two chat requests that share a long
prefix through it, prints the answers with their TTFT and cache use, and stops."""

from __future__ import annotations

import logging
import signal
import sys
import tempfile
import tomllib
from pathlib import Path

import click

from kvpool.errors import InvalidArgument

DEFAULT_CONFIG = {
    "pool": {"dram_capacity": "1GiB", "ssd_capacity": "8GiB", "eviction": "arc"},
    "workers": [{"role": "prefill", "local_cache": "512MiB"}, {"role": "decode", "local_cache": "512MiB"}],
}

# The shared prefix of the demo's two requests: a long system prompt (~700 tokens).
HANDBOOK = " ".join(
    f"Section {i}. The harbour office of Port Avel opens at {6 + i % 4} in the morning and closes at "
    f"{17 + i % 3} in the evening. Ships longer than {40 + 5 * i} metres must announce themselves "
    f"{i + 1} hours ahead on channel {10 + i}, and pilots board them at buoy {chr(65 + i)}."
    for i in range(16)
)
DEMO_QUESTIONS = ("When does the harbour office open according to section 3?",
                  "Which channel must ships use according to section 5?")


def _flags(table: dict) -> list[str]:
    args: list[str] = []
    for key, value in table.items():
        if key in ("role", "name") or value is None:
            continue
        args += [f"--{key.replace('_', '-')}", str(value)]
    return args


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _load_config(path: str | None) -> dict:
    if path is None:
        return DEFAULT_CONFIG
    try:
        doc = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise InvalidArgument(f"cannot read {path}: {exc}") from None
    return {"pool": doc.get("pool", {}), "workers": doc.get("workers", DEFAULT_CONFIG["workers"])}


@click.command()
@click.option("--config", "config_file", type=click.Path(dir_okay=False, exists=True),
              help="Cluster file (see deploy/local.toml); default: one prefill and one decode worker.")
@click.option("--demo", is_flag=True, help="Send two chat requests sharing a long prefix, print, stop.")
@click.option("--max-tokens", type=int, default=32, show_default=True, help="Tokens per demo answer.")
@click.option("--workdir", type=click.Path(file_okay=False), help="Logs and ready files (default: a temp dir).")
@click.option("--ssd-path", type=click.Path(file_okay=False), help="Give the pool an SSD tier here.")
def up(config_file, demo, max_tokens, workdir, ssd_path) -> None:
    """Start the embedded pool + reference workers as separate processes on free loopback ports."""
    from rich.console import Console

    from engine_adapters.serving.launcher import LocalCluster, PoolSpec, WorkerSpec

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise here

    config = _load_config(config_file)
    pool_table = dict(config["pool"])
    if ssd_path:
        pool_table["ssd_path"] = ssd_path
    workers = [WorkerSpec(role=w["role"], name=w.get("name", ""), args=_flags(w)) for w in config["workers"]]
    roles = {w.role for w in workers}
    if demo and not ({"prefill", "decode"} <= roles):
        raise click.UsageError("--demo needs a prefill and a decode worker in the cluster file")
    workdir = workdir or tempfile.mkdtemp(prefix="kvpool-up-")
    console = Console(stderr=True)
    cluster = LocalCluster(workdir, workers, PoolSpec(args=_flags(pool_table)))
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM ends the cluster as cleanly as Ctrl-C does
    try:
        with console.status("starting the local cluster") as status:
            def progress(msg: str) -> None:
                status.update(msg)
                console.log(msg)

            cluster.start(progress)
        prefill_url = cluster.url("prefill") if "prefill" in roles else ""
        decode_url = cluster.url("decode") if "decode" in roles else ""
        click.echo(f"pool     {cluster.pool_address}")
        for name, proc in cluster.workers.items():
            click.echo(f"{name:<8} {proc.url}")
        click.echo(f"logs     {workdir}")
        if demo:
            _demo(prefill_url, decode_url, max_tokens)
            return
        if prefill_url and decode_url:
            click.echo(f"\ntry: kvpool generate --prefill {prefill_url} --decode {decode_url} "
                       f"--message 'What is a KV cache?'\n")
        click.echo("serving; Ctrl-C stops the cluster")
        while True:
            signal.pause()
    except KeyboardInterrupt:
        click.echo("\nstopping", err=True)
    finally:
        cluster.stop()
        click.echo("stopped", err=True)


def _demo(prefill_url: str, decode_url: str, max_tokens: int) -> None:
    from engine_adapters.serving.client import WorkerClient, generate

    with WorkerClient(prefill_url) as prefill, WorkerClient(decode_url) as decode:
        for i, question in enumerate(DEMO_QUESTIONS, 1):
            ids = prefill.tokenize(messages=[{"role": "system", "content": HANDBOOK},
                                             {"role": "user", "content": question}])
            if i > 1:
                # Otherwise the prefill worker's own prefix cache (its "HBM" tier) would answer;
                # emptying it shows the shared prefix coming back from the pool.
                prefill.clear_cache()
                click.echo("\n(prefill worker's local prefix cache cleared: the shared prefix must come "
                           "from the pool)")
            click.echo(f"\n[{i}] {question}\n    ", nl=False)
            gen = generate(prefill, decode, ids, max_tokens,
                           on_text=lambda t: (sys.stdout.write(t.replace("\n", "\n    ")), sys.stdout.flush()))
            click.echo(f"\n    TTFT {gen.ttft_ms:.0f} ms | prompt {gen.prompt_tokens} tokens: "
                       f"{gen.cached_tokens} from the cache ({gen.pool_cached_tokens} pool, "
                       f"{gen.local_cached_tokens} worker-local), {gen.computed_tokens} computed")
