"""`kvpool router`: the cache-aware router with an OpenAI-compatible API, on its own."""

from __future__ import annotations

import click


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8000, show_default=True, help="HTTP port (0: any free port).")
@click.option("--pool", "pool_address", help="Pool address HOST:PORT for match_prefix (default: none; "
                                             "then only the workers' own caches count).")
@click.option("--worker", "workers", multiple=True, metavar="URL",
              help="A worker to route to (repeatable); workers started with --router URL join by themselves.")
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
def router(host, port, pool_address, workers, policy, ttft_slo_ms, tbt_slo_ms, local_prefill_tokens,
           default_max_tokens, model_name, ready_file) -> None:
    """Serve /v1/chat/completions, /v1/completions and /v1/models, placing each request on the
    workers by estimated cost (see kvpool/router/policy.py); /admin/workers lists them."""
    from kvpool.router.server import serve
    from kvpool.router.service import RouterConfig

    config = RouterConfig(pool=pool_address, policy=policy, workers=list(workers),
                          ttft_slo_s=None if ttft_slo_ms is None else ttft_slo_ms / 1e3,
                          tbt_slo_s=None if tbt_slo_ms is None else tbt_slo_ms / 1e3,
                          local_prefill_tokens=local_prefill_tokens, default_max_tokens=default_max_tokens,
                          model_name=model_name)
    serve(config, host=host, port=port, ready_file=ready_file,
          on_ready=lambda url: click.echo(f"kvpool router serving at {url}", nl=True))
