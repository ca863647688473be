"""`kvpool generate`: one request through the disaggregated path (prefill worker -> pool ->
decode worker), streaming the text. `--json` ends the output with one JSON line."""

from __future__ import annotations

import json

import click

from kvpool.cli.service_options import config_options, settings_from


@click.command()
@config_options
@click.option("--prefill", "prefill_url", required=True, help="Prefill worker URL, e.g. http://127.0.0.1:8100")
@click.option("--decode", "decode_url", required=True, help="Decode worker URL, e.g. http://127.0.0.1:8200")
@click.option("--prompt", help="Plain text prompt (no chat template).")
@click.option("--message", help="One user message, rendered with the model's chat template.")
@click.option("--max-tokens", type=click.IntRange(1, 4096), default=64, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="End with one JSON line: text, token_ids, ttft_ms, "
              "cached_tokens, computed_tokens.")
def generate(config_file, sets, prefill_url, decode_url, prompt, message, max_tokens, as_json) -> None:
    """Send PROMPT (or MESSAGE) through a prefill and a decode worker and stream the answer.
    With a keyring ([security] auth_file) it presents the workers' internal token."""
    from kvpool.security.http_guard import internal_headers
    from reference_worker.client import WorkerClient, generate as run

    if (prompt is None) == (message is None):
        raise click.UsageError("give exactly one of --prompt or --message")
    settings_from(config_file, sets)
    headers = internal_headers()
    with WorkerClient(prefill_url, headers=headers) as prefill, WorkerClient(decode_url, headers=headers) as decode:
        messages = None if message is None else [{"role": "user", "content": message}]
        ids = prefill.tokenize(prompt=prompt, messages=messages)
        gen = run(prefill, decode, ids, max_tokens, on_text=lambda text: click.echo(text, nl=False))
    click.echo()
    click.echo(f"[{gen.prompt_tokens} prompt tokens: {gen.cached_tokens} cached "
               f"({gen.local_cached_tokens} worker-local, {gen.pool_cached_tokens} pool), "
               f"{gen.computed_tokens} computed; TTFT {gen.ttft_ms:.0f} ms; {len(gen.token_ids)} tokens in "
               f"{gen.total_ms:.0f} ms; {gen.finish_reason}]", err=True)
    if as_json:
        click.echo(json.dumps(gen.summary()))
