"""`kvpool router`: the cache-aware router with an OpenAI-compatible API, on its own.

Its options are the common ones; every other `[router]` setting (the SLOs, the default
max_tokens, the served model name, the vLLM servers' dtype) comes from the configuration tree:
`--set router.ttft_slo_ms=500`, `KVPOOL_ROUTER__TTFT_SLO_MS`, or `[router]` in the file."""

from __future__ import annotations

import click

from kvpool.cli.service_options import config_options, settings_from


@click.command()
@config_options
@click.option("--host", help="Address to listen on (default 127.0.0.1).")
@click.option("--port", type=int, help="HTTP port (default 8000; 0: any free port).")
@click.option("--pool", help="Pool address HOST:PORT for match_prefix (default: none; then only the workers' own "
                             "caches count).")
@click.option("--worker", "workers", multiple=True, metavar="[ROLE=]URL",
              help="A worker to route to (repeatable); workers started with --router URL join by themselves. "
                   "With --engine vllm, ROLE is prefill, decode or both (default both).")
@click.option("--engine", type=click.Choice(["reference", "vllm"]),
              help="The workers' engine (as `kvpool up --engine`): kvpool's reference workers (default), or vLLM "
                   "OpenAI servers running the kvpool connector (prefill = kv_producer, decode = kv_consumer; see "
                   "docs/vllm.md).")
@click.option("--tokenizer", type=click.Path(file_okay=False, exists=True),
              help="--engine vllm: the model folder the vLLM servers load (tokenizer.json, chat template, "
                   "config.json for the KV layout).")
@click.option("--kv-connector-config", metavar="JSON",
              help="--engine vllm: the kv_connector_extra_config the servers were given (chunk_tokens, model_id, "
                   "weights_fingerprint, tenant_salt), so the router hashes prompts into their key space.")
@click.option("--kv-events", multiple=True, metavar="URL=ENDPOINT[,REPLAY]",
              help="--engine vllm: the server at URL publishes its KV events at ENDPOINT (its --kv-events-config "
                   "endpoint, as the router connects to it: tcp://HOST:PORT or ipc://PATH) and replays missed ones at "
                   "REPLAY; the router then knows what that server's own prefix cache holds (repeatable).")
@click.option("--policy", type=click.Choice(["cache_aware", "least_loaded", "round_robin"]),
              help="How to place requests (default cache_aware).")
@click.option("--local-prefill-tokens", type=int,
              help="Uncached prompts at most this long are prefilled on the decode worker itself "
                   "(conditional disaggregation; 0 disables; default 256).")
@click.option("--ready-file", type=click.Path(dir_okay=False), help="Write {url, port, pid} here once serving.")
def router(config_file, sets, ready_file, **flags) -> None:
    """Serve /v1/chat/completions, /v1/completions and /v1/models, placing each request on the
    workers by estimated cost (see kvpool/router/policy.py); /admin/workers lists them.

    With --engine vllm the workers are vLLM OpenAI servers: each request is prefilled on a prefill
    server (max_tokens=1, its KV goes to the pool) and streamed from a decode server (which loads
    that KV from the pool), with kv_transfer_params passed as vLLM's disaggregation proxy passes them.
    """
    from kvpool.router.server import serve
    from kvpool.router.service import RouterConfig

    for name in ("workers", "kv_events"):  # repeatable options: not given is (), which changes nothing
        flags[name] = list(flags[name]) or None
    settings = settings_from(config_file, sets, router=flags)
    serve(RouterConfig.from_settings(settings), host=settings.router.host, port=settings.router.port,
          ready_file=ready_file, on_ready=lambda url: click.echo(f"kvpool router serving at {url}", nl=True))
