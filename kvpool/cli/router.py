"""`kvpool router`: the cache-aware router with an OpenAI-compatible API, on its own."""

from __future__ import annotations

import click


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8000, show_default=True, help="HTTP port (0: any free port).")
@click.option("--pool", "pool_address", help="Pool address HOST:PORT for match_prefix (default: none; "
                                             "then only the workers' own caches count).")
@click.option("--worker", "workers", multiple=True, metavar="[ROLE=]URL",
              help="A worker to route to (repeatable); workers started with --router URL join by themselves. "
                   "With --engine vllm, ROLE is prefill, decode or both (default both).")
@click.option("--engine", type=click.Choice(["reference", "vllm"]), default="reference", show_default=True,
              help="The workers' engine (as `kvpool up --engine`): kvpool's reference workers, or vLLM OpenAI servers running the kvpool "
                   "connector (prefill = kv_producer, decode = kv_consumer; see docs/vllm.md).")
@click.option("--tokenizer", "tokenizer_path", type=click.Path(file_okay=False, exists=True),
              help="--engine vllm: the model folder the vLLM servers load (tokenizer.json, chat template, "
                   "config.json for the KV layout).")
@click.option("--kv-connector-config", "kv_connector_config", metavar="JSON",
              help="--engine vllm: the kv_connector_extra_config the servers were given (chunk_tokens, model_id, "
                   "weights_fingerprint, tenant_salt), so the router hashes prompts into their key space.")
@click.option("--kv-dtype", type=click.Choice(["bfloat16", "float16", "float32"]),
              help="--engine vllm: the servers' --dtype (default: what their --dtype auto picks: the "
                   "model's config.json dtype, float32 downcast to bfloat16).")
@click.option("--kv-events", "kv_events", multiple=True, metavar="URL=ENDPOINT[,REPLAY]",
              help="--engine vllm: the server at URL publishes its KV events at ENDPOINT (its --kv-events-config "
                   "endpoint, as the router connects to it: tcp://HOST:PORT or ipc://PATH) and replays missed ones at "
                   "REPLAY; the router then knows what that server's own prefix cache holds (repeatable).")
@click.option("--policy", type=click.Choice(["cache_aware", "least_loaded", "round_robin"]), default="cache_aware",
              show_default=True, help="How to place requests.")
@click.option("--ttft-slo-ms", type=float, help="Refuse (429) requests whose best estimated TTFT is above this.")
@click.option("--tbt-slo-ms", type=float, help="Decode only where the time between tokens stays under this; "
                                               "refuse (429) when no worker can.")
@click.option("--local-prefill-tokens", type=int, default=256, show_default=True,
              help="Uncached prompts at most this long are prefilled on the decode worker itself "
                   "(conditional disaggregation; 0 disables).")
@click.option("--default-max-tokens", type=int, default=1024, show_default=True,
              help="Completion budget of chat requests that give no max_tokens.")
@click.option("--model-name", help="Model name served at /v1/models (default: the workers' model id).")
@click.option("--ready-file", type=click.Path(dir_okay=False), help="Write {url, port, pid} here once serving.")
def router(host, port, pool_address, workers, engine, tokenizer_path, kv_connector_config, kv_dtype, kv_events, policy,
           ttft_slo_ms, tbt_slo_ms, local_prefill_tokens, default_max_tokens, model_name, ready_file) -> None:
    """Serve /v1/chat/completions, /v1/completions and /v1/models, placing each request on the
    workers by estimated cost (see kvpool/router/policy.py); /admin/workers lists them.

    With --engine vllm the workers are vLLM OpenAI servers: each request is prefilled on a prefill
    server (max_tokens=1, its KV goes to the pool) and streamed from a decode server (which loads
    that KV from the pool), with kv_transfer_params passed as vLLM's disaggregation proxy passes them.
    """
    import json

    from kvpool.router.server import serve
    from kvpool.router.service import RouterConfig
    from kvpool.router.backends.vllm import VLLMSettings

    vllm = None
    if engine == "vllm":
        if not tokenizer_path:
            raise click.UsageError("--engine vllm needs --tokenizer MODEL_FOLDER")
        try:
            connector = json.loads(kv_connector_config) if kv_connector_config else {}
        except ValueError as exc:
            raise click.BadParameter(f"not JSON: {exc}", param_hint="--kv-connector-config") from None
        if not isinstance(connector, dict):
            raise click.BadParameter("expected a JSON object", param_hint="--kv-connector-config")
        vllm = VLLMSettings(model_path=tokenizer_path, connector=connector, kv_dtype=kv_dtype)

    config = RouterConfig(pool=pool_address, policy=policy, workers=list(workers),
                          ttft_slo_s=None if ttft_slo_ms is None else ttft_slo_ms / 1e3,
                          tbt_slo_s=None if tbt_slo_ms is None else tbt_slo_ms / 1e3,
                          local_prefill_tokens=local_prefill_tokens, default_max_tokens=default_max_tokens,
                          model_name=model_name, engine=engine, vllm=vllm, kv_events=list(kv_events))
    serve(config, host=host, port=port, ready_file=ready_file,
          on_ready=lambda url: click.echo(f"kvpool router serving at {url}", nl=True))
