"""`kvpool up`: a local cluster of real processes (embedded pool, reference workers on the
reference model, the router with its OpenAI API in front), serving until Ctrl-C. `--demo` sends
two chat requests that share a long prefix through the router with the OpenAI client, prints the
answers with their TTFT and cached tokens, and stops. `--engine vllm` runs vLLM OpenAI servers
with the kvpool connector instead of the reference workers (kvpool/tools/launch/vllm.py).
`--auth-file KEYRING` (from `kvpool auth init`) turns authentication on: every process it starts
gets KVPOOL_AUTH_FILE, and the router then wants a tenant's API key (docs/security.md). Without it
the processes share their user's own keyring (`kvpool.security.local`), which they find by themselves."""

from __future__ import annotations

import logging
import os
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
@click.option("--port", type=int, help="Port of the router's OpenAI API (default 8000; with --demo any free "
                                      "port; 0: any free port).")
@click.option("--prefill", "n_prefill", type=int, help="Prefill workers (with --decode; overrides the file).")
@click.option("--decode", "n_decode", type=int, help="Decode workers (with --prefill).")
@click.option("--colocated", "n_colocated", type=int, help="Workers that prefill and decode (--role both) "
                                                              "instead of separate ones.")
@click.option("--policy", type=click.Choice(["cache_aware", "least_loaded", "round_robin"]), default="cache_aware",
              show_default=True, help="The router's placement policy.")
@click.option("--router-arg", "router_args", multiple=True, metavar="FLAG",
              help="Extra `kvpool router` flag, e.g. --router-arg=--ttft-slo-ms=5000 (repeatable).")
@click.option("--worker-arg", "worker_args", multiple=True, metavar="FLAG",
              help="Extra `kvpool worker` flag for every worker, e.g. --worker-arg=--threads=1 (repeatable).")
@click.option("--demo", is_flag=True, help="Send two chat requests sharing a long prefix through the router "
                                           "(OpenAI API), print them with TTFT and cached tokens, stop.")
@click.option("--max-tokens", type=int, default=32, show_default=True, help="Tokens per demo answer.")
@click.option("--workdir", type=click.Path(file_okay=False), help="Logs and ready files (default: a temp dir).")
@click.option("--ssd-path", type=click.Path(file_okay=False), help="Give the pool an SSD tier here.")
@click.option("--engine", type=click.Choice(["reference", "vllm"]), default="reference", show_default=True,
              help="The workers: kvpool's reference workers, or vLLM OpenAI servers with the kvpool connector "
                   "(prefill: kv_producer, decode: kv_consumer, colocated: kv_both; needs vLLM, see docs/vllm.md).")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default="bfloat16",
              show_default=True, help="--engine vllm: the servers' dtype (float32: greedy output bit-stable "
                                      "whatever is cached; see docs/vllm.md, Limits).")
@click.option("--chunk-tokens", type=int, default=256, show_default=True,
              help="--engine vllm: tokens per pool chunk (a multiple of the block size, 32).")
@click.option("--vllm-python", type=click.Path(dir_okay=False, exists=True),
              help="--engine vllm: the Python that runs the servers (default: this one; it must import vllm).")
@click.option("--vllm-arg", "vllm_args", multiple=True, metavar="FLAG",
              help="--engine vllm: extra flag for every vLLM server, e.g. --vllm-arg=--max-num-seqs=8 (repeatable).")
@click.option("--kv-codec", default="none", show_default=True, metavar="CODEC",
              help="How every worker stores KV chunks in the pool (`kvpool worker --kv-codec`): none (lossless), "
                   "int8, fp8, or one of those + '+zstd'; lossy codecs are opt-in.")
@click.option("--cpus-per-worker", type=click.IntRange(min=0), default=0, show_default=True, metavar="N",
              help="Give each worker (or vLLM server) N cores of its own, in order (0: no pinning, the kernel "
                   "shares every core). The router and the pool are not pinned.")
@click.option("--auth-file", type=click.Path(dir_okay=False, exists=True),
              help="Keyring (`kvpool auth init`): authentication on every port, API keys at the router; passed "
                   "to every process as KVPOOL_AUTH_FILE [default: the user's own keyring, ~/.config/kvpool, on the "
                   "pool's ports; the router and workers open on loopback; KVPOOL_LOCAL_AUTH=off: all open].")
def up(config_file, port, n_prefill, n_decode, n_colocated, policy, router_args, worker_args, demo, max_tokens,
       workdir, ssd_path, engine, dtype, chunk_tokens, vllm_python, vllm_args, kv_codec, cpus_per_worker, auth_file) -> None:
    """Start the pool, the workers and the router as separate processes on loopback.

    The router's OpenAI-compatible API is at http://127.0.0.1:PORT/v1; Ctrl-C stops everything.
    """
    from rich.console import Console

    from kvpool.tools.launch.local import LocalCluster, PoolSpec, RouterSpec, WorkerSpec

    for name in ("httpx", "httpx2"):  # one line per request is noise here (httpx2: the openai client's)
        logging.getLogger(name).setLevel(logging.WARNING)
    if port is None:  # the demo needs no fixed port; a server keeps the usual one
        port = 0 if demo else 8000

    api_key = "unused"
    if auth_file:
        from kvpool.security.keyring import AUTH_FILE_ENV, Keyring

        keyring = Keyring.load(auth_file)  # a bad or readable file fails here, not in five processes
        os.environ[AUTH_FILE_ENV] = str(Path(auth_file).resolve())  # inherited by every process started below
        api_key = next((k for e in keyring.entries.values() for k in e.api_keys), api_key)
    from kvpool.codec import get_codec

    get_codec(kv_codec)  # an unknown name fails here, not in every worker
    config = _load_config(config_file)
    pool_table = dict(config["pool"])
    if ssd_path:
        pool_table["ssd_path"] = ssd_path
    tables = _worker_tables(config["workers"], n_prefill, n_decode, n_colocated)
    cores = None
    if cpus_per_worker:
        from reference_worker.cpus import plan

        cores = plan(len(tables), cpus_per_worker)
    workdir = workdir or tempfile.mkdtemp(prefix="kvpool-up-")
    console = Console(stderr=True)
    if engine == "vllm":
        from kvpool.tools.launch.vllm import VLLMCluster, check_python, reference_spec

        if worker_args:
            raise click.UsageError("--worker-arg is for the reference workers; vLLM servers take --vllm-arg")
        if kv_codec != "none":
            raise click.UsageError("--kv-codec is for the reference workers; a vLLM server takes kv_codec in its "
                                   "kv_connector_extra_config (docs/vllm.md)")

        python = vllm_python or sys.executable
        check_python(python)
        spec = reference_spec(python=python, dtype=dtype, chunk_tokens=chunk_tokens, extra_args=list(vllm_args))
        cluster = VLLMCluster(workdir, spec, [w["role"] for w in tables], pool_args=_flags(pool_table),
                              router_port=port, router_args=["--policy", policy, *router_args], cpus=cores)
    else:
        codec_args = ["--kv-codec", kv_codec] if kv_codec != "none" else []
        from reference_worker.cpus import format_list

        workers = [WorkerSpec(role=w["role"], name=w.get("name", ""),
                              args=_flags(w) + codec_args + list(worker_args)
                              + (["--cpus", format_list(cores[i])] if cores else []))
                   for i, w in enumerate(tables)]
        cluster = LocalCluster(workdir, workers, PoolSpec(args=_flags(pool_table)),
                               router=RouterSpec(port=port, args=["--policy", policy, *router_args]))
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM ends the cluster as cleanly as Ctrl-C does
    try:
        with console.status("starting the local cluster") as status:
            def progress(msg: str) -> None:
                status.update(msg)
                console.log(msg)

            cluster.start(progress)
        base = f"{cluster.router_url}/v1"
        click.echo(f"pool     {cluster.pool_address}")
        for name, proc in (cluster.servers if engine == "vllm" else cluster.workers).items():
            click.echo(f"{name:<10} {proc.url}")
        click.echo(f"logs     {workdir}")
        click.echo(f"\nOpenAI API: {base}   (policy {policy}; workers: {cluster.router_url}/admin/workers)")
        click.echo(f"dashboard:  {cluster.router_url}/dashboard" + ("#token=<internal token>" if auth_file else ""))
        auth_header = f"-H 'authorization: Bearer {api_key}' " if auth_file else ""
        click.echo(f"try: curl -s {base}/chat/completions {auth_header}-H 'content-type: application/json' "
                   f"-d '{{\"model\": \"{MODEL}\", \"messages\": [{{\"role\": \"user\", \"content\": "
                   f"\"What is a KV cache?\"}}], \"max_tokens\": 32}}'\n")
        if demo:
            _demo(base, max_tokens, api_key)
            return
        click.echo("serving; Ctrl-C stops the cluster")
        while True:
            signal.pause()
    except KeyboardInterrupt:
        click.echo("\nstopping", err=True)
    finally:
        cluster.stop()
        click.echo("stopped", err=True)


MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _worker_tables(tables: list[dict], n_prefill: int | None, n_decode: int | None,
                   n_colocated: int | None) -> list[dict]:
    if n_colocated is not None:
        if n_prefill is not None or n_decode is not None:
            raise click.UsageError("--colocated excludes --prefill/--decode")
        if n_colocated < 1:
            raise click.UsageError("--colocated needs at least 1 worker")
        return [{"role": "both", "local_cache": "512MiB"} for _ in range(n_colocated)]
    if n_prefill is not None or n_decode is not None:
        if (n_prefill or 0) < 1 or (n_decode or 0) < 1:
            raise click.UsageError("--prefill and --decode each need at least 1 worker")
        return ([{"role": "prefill", "local_cache": "512MiB"} for _ in range(n_prefill)]
                + [{"role": "decode", "local_cache": "512MiB"} for _ in range(n_decode)])
    return list(tables)


def _demo(base_url: str, max_tokens: int, api_key: str = "unused") -> None:
    """Two chat requests sharing a long system prompt, through the router with the OpenAI client."""
    import time

    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key)
    model = client.models.list().data[0].id
    for i, question in enumerate(DEMO_QUESTIONS, 1):
        click.echo(f"\n[{i}] {question}\n    ", nl=False)
        started = time.perf_counter()
        ttft = None
        usage = None
        stream = client.chat.completions.create(
            model=model, max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
            messages=[{"role": "system", "content": HANDBOOK}, {"role": "user", "content": question}])
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                text = choice.delta.content or ""
                if text and ttft is None:
                    ttft = time.perf_counter() - started
                sys.stdout.write(text.replace("\n", "\n    "))
                sys.stdout.flush()
        cached = usage.prompt_tokens_details.cached_tokens if usage and usage.prompt_tokens_details else 0
        prompt = usage.prompt_tokens if usage else 0
        click.echo(f"\n    TTFT {1e3 * (ttft or 0):.0f} ms | prompt {prompt} tokens, {cached} from the cache, "
                   f"{prompt - cached} computed")
