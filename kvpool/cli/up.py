"""`kvpool up`: a local cluster of real processes (pool, reference or vLLM workers, the router),
serving until Ctrl-C; `--demo` sends two requests sharing a prefix and stops. The work is
`kvpool.tools.launch.up` (a tool: it starts processes); this module parses the flags into the one
configuration tree (docs/configuration.md) that every process it starts reads."""

from __future__ import annotations

from pathlib import Path

import click

from kvpool.cli.service_options import config_options, settings_from


@click.command()
@config_options
@click.option("--port", type=int, help="Port of the router's OpenAI API (default [router] port, 8000; with --demo "
                                      "any free port; 0: any free port).")
@click.option("--prefill", "n_prefill", type=int, help="Prefill workers (with --decode; instead of [[workers]]).")
@click.option("--decode", "n_decode", type=int, help="Decode workers (with --prefill).")
@click.option("--colocated", "n_colocated", type=int, help="Workers that prefill and decode (--role both) "
                                                              "instead of separate ones.")
@click.option("--engine", type=click.Choice(["reference", "vllm"]),
              help="The workers: kvpool's reference workers (default), or vLLM OpenAI servers with the kvpool "
                   "connector (prefill: kv_producer, decode: kv_consumer, colocated: kv_both; needs vLLM, see "
                   "docs/vllm.md; [up] vllm_dtype, vllm_python shape them).")
@click.option("--vllm-arg", "vllm_args", multiple=True, metavar="FLAG",
              help="--engine vllm: extra flag for every vLLM server, e.g. --vllm-arg=--max-num-seqs=8 (repeatable).")
@click.option("--kv-codec", metavar="CODEC",
              help="How every worker stores KV chunks in the pool ([pool] kv_codec): none (lossless, the default), "
                   "int8, fp8, or one of those + '+zstd'; lossy codecs are opt-in.")
@click.option("--cpus-per-worker", type=click.IntRange(min=0), metavar="N",
              help="Give each worker (or vLLM server) N cores of its own, in order (default 0: no pinning, the "
                   "kernel shares every core). The router and the pool are not pinned.")
@click.option("--auth-file", type=click.Path(dir_okay=False, exists=True),
              help="Keyring (`kvpool auth init`): authentication on every port, API keys at the router; passed "
                   "to every process as KVPOOL_AUTH_FILE [default: the user's own keyring, ~/.config/kvpool, on the "
                   "pool's ports; the router and workers open on loopback; KVPOOL_LOCAL_AUTH=off: all open].")
@click.option("--workdir", type=click.Path(file_okay=False), help="Logs and ready files (default: a temp dir).")
@click.option("--demo", is_flag=True, help="Send two chat requests sharing a long prefix through the router "
                                           "(OpenAI API), print them with TTFT and cached tokens, stop.")
@click.option("--max-tokens", type=int, default=32, show_default=True, help="Tokens per demo answer.")
def up(config_file, sets, port, n_prefill, n_decode, n_colocated, engine, vllm_args, kv_codec, cpus_per_worker,
       auth_file, workdir, demo, max_tokens) -> None:
    """Start the pool, the workers and the router as separate processes on loopback.

    The router's OpenAI-compatible API is at http://127.0.0.1:PORT/v1; Ctrl-C stops everything.
    """
    from kvpool.tools.launch.up import run_up

    settings = settings_from(config_file, sets, pool={"kv_codec": kv_codec}, router={"engine": engine},
                             security={"auth_file": auth_file and str(Path(auth_file).resolve())},
                             up={"workdir": workdir, "cpus_per_worker": cpus_per_worker,
                                 "vllm_args": list(vllm_args) or None})
    run_up(settings, config_file, port, n_prefill, n_decode, n_colocated, demo, max_tokens)
