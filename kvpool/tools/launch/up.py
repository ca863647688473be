"""`kvpool up` (its flags: kvpool/cli/up.py): a local cluster of real processes (embedded pool,
reference workers on the reference model, the router with its OpenAI API in front), serving until
Ctrl-C, or, with `demo`, until two chat requests that share a long prefix have gone through the
router with the OpenAI client. `[router] engine = "vllm"` runs vLLM OpenAI servers with the kvpool
connector instead of the reference workers (vllm.py). `[security] auth_file` reaches every process
as KVPOOL_AUTH_FILE (the router then wants a tenant's API key, docs/security.md); without it they
share their user's own keyring (`kvpool.security.local`), which they find by themselves.

One configuration tree for all of them (docs/configuration.md): the file reaches every process as
KVPOOL_CONFIG, each value a flag or `--set` gave as its KVPOOL_<SECTION>__<FIELD> variable, so the
pool reads `[node]`, the router `[router]` and each worker `[worker]` of the same file; `[[workers]]`
lists the workers (a role each, and `[worker]` settings of their own), `[up]` holds up's own."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import tempfile
from pathlib import Path

import click

from kvpool.config import CONFIG_ENV, ROOT_ENV, Settings, UpWorker, env_names

# The shared prefix of the demo's two requests: a long system prompt (~700 tokens).
HANDBOOK = " ".join(
    f"Section {i}. The harbour office of Port Avel opens at {6 + i % 4} in the morning and closes at "
    f"{17 + i % 3} in the evening. Ships longer than {40 + 5 * i} metres must announce themselves "
    f"{i + 1} hours ahead on channel {10 + i}, and pilots board them at buoy {chr(65 + i)}."
    for i in range(16)
)
DEMO_QUESTIONS = ("When does the harbour office open according to section 3?",
                  "Which channel must ships use according to section 5?")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def run_up(settings: Settings, config_file: str | None, port: int | None, n_prefill: int | None,
           n_decode: int | None, n_colocated: int | None, demo: bool, max_tokens: int) -> None:
    """Start the pool, the workers and the router as processes on loopback; serve until Ctrl-C
    or SIGTERM (with `demo`: until the demo is done), then stop them all. `port` None: the
    configured router port (with `demo`: any free one, unless configured); the counts, when given,
    replace `[[workers]]`."""
    from rich.console import Console

    from kvpool.tools.launch.local import LocalCluster, PoolSpec, RouterSpec, WorkerSpec

    for name in ("httpx", "httpx2"):  # one line per request is noise here (httpx2: the openai client's)
        logging.getLogger(name).setLevel(logging.WARNING)
    if port is None:  # the demo needs no fixed port; a server keeps the configured one
        port = 0 if demo and settings.source("router.port") == "default" else settings.router.port
    engine, policy, cfg = settings.router.engine, settings.router.policy, settings.up

    api_key = "unused"
    if settings.security.auth_file:
        from kvpool.security.keyring import Keyring

        keyring = Keyring.load(settings.security.auth_file)  # a bad or readable file fails here, not in five processes
        api_key = next((k for e in keyring.entries.values() for k in e.api_keys), api_key)
    from kvpool.codec import get_codec

    get_codec(settings.pool.kv_codec)  # an unknown name fails here, not in every worker
    # Every process started below reads the same tree: this process's environment, the file, and
    # what was set here, each as the variable that sets it.
    os.environ.update(_child_environment(config_file, settings))
    workers = _workers(settings.workers, n_prefill, n_decode, n_colocated)
    cores = None
    if cfg.cpus_per_worker:
        from reference_worker.cpus import plan

        cores = plan(len(workers), cfg.cpus_per_worker)
    workdir = cfg.workdir or tempfile.mkdtemp(prefix="kvpool-up-")
    console = Console(stderr=True)
    if engine == "vllm":
        from kvpool.tools.launch.vllm import VLLMCluster, check_python, reference_spec

        if any(w.settings for w in workers):
            raise click.UsageError("[[workers]] settings are the reference workers'; vLLM servers take --vllm-arg")
        if settings.pool.kv_codec != "none":
            raise click.UsageError("--kv-codec is for the reference workers; a vLLM server takes kv_codec in its "
                                   "kv_connector_extra_config (docs/vllm.md)")

        python = cfg.vllm_python or sys.executable
        check_python(python)
        spec = reference_spec(python=python, dtype=cfg.vllm_dtype, chunk_tokens=settings.pool.chunk_tokens,
                              extra_args=list(cfg.vllm_args))
        cluster = VLLMCluster(workdir, spec, [w.role for w in workers], router_port=port, cpus=cores)
    else:
        from reference_worker.cpus import format_list

        specs = [WorkerSpec(role=w.role, name=w.name, args=_worker_args(w) + (["--cpus", format_list(cores[i])]
                                                                              if cores else []))
                 for i, w in enumerate(workers)]
        cluster = LocalCluster(workdir, specs, PoolSpec(), router=RouterSpec(port=port))
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
        authenticated = bool(settings.security.auth_file)
        click.echo(f"dashboard:  {cluster.router_url}/dashboard" + ("#token=<internal token>" if authenticated else ""))
        auth_header = f"-H 'authorization: Bearer {api_key}' " if authenticated else ""
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


def _child_environment(config_file: str | None, settings: Settings) -> dict[str, str]:
    """The variables that give the processes `kvpool up` starts the tree it runs with: the file
    (KVPOOL_CONFIG), and each value a flag or `--set` gave (KVPOOL_<SECTION>__<FIELD>)."""
    env = {CONFIG_ENV: str(Path(config_file).resolve())} if config_file else {}
    for path, origin in settings.sources().items():
        if not origin.startswith("flag"):
            continue  # the file and this environment reach them anyway
        section, _, field = path.partition(".")
        value = getattr(getattr(settings, section), field) if field else getattr(settings, path)
        if isinstance(value, list) and value and not isinstance(value[0], str):
            value = [v.model_dump() for v in value]  # [[workers]]
        env[env_names(section, field)[0] if field else ROOT_ENV[path]] = (
            value if isinstance(value, str) else json.dumps(value))
    return env


def _worker_args(worker: UpWorker) -> list[str]:
    """A `[[workers]]` entry's own settings, as `kvpool worker` flags (over `[worker]`)."""
    return [a for k, v in worker.settings.items()
            for a in ("--set", f"worker.{k}={v if isinstance(v, str) else json.dumps(v)}")]


MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _workers(configured: list[UpWorker], n_prefill: int | None, n_decode: int | None,
             n_colocated: int | None) -> list[UpWorker]:
    """`[[workers]]`, unless the counts on the command line replace it."""
    if n_colocated is not None:
        if n_prefill is not None or n_decode is not None:
            raise click.UsageError("--colocated excludes --prefill/--decode")
        if n_colocated < 1:
            raise click.UsageError("--colocated needs at least 1 worker")
        return [UpWorker(role="both") for _ in range(n_colocated)]
    if n_prefill is not None or n_decode is not None:
        if (n_prefill or 0) < 1 or (n_decode or 0) < 1:
            raise click.UsageError("--prefill and --decode each need at least 1 worker")
        return [UpWorker(role="prefill") for _ in range(n_prefill)] + [UpWorker(role="decode") for _ in range(n_decode)]
    return list(configured)


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
