"""`kvpool worker`: a reference prefill / decode worker on the reference model.

The CLI is the one place in `kvpool` that sees `engine_adapters` (imported on use). Its options
are the common ones; every other setting (`[worker]` max_kv_tokens, drain_timeout_s,
model_cache; `[pool]` chunk_tokens, the chunk format it shares with the other workers) comes from
the configuration tree: `--set worker.max_kv_tokens=0`, `KVPOOL_WORKER__MAX_KV_TOKENS`, or the file.

The tenant salt is a secret (it keys the namespace), so it never comes from argv, which any local
user reads in `ps`: `[security] tenant_salt_file` (KVPOOL_TENANT_SALT_FILE) or KVPOOL_TENANT_SALT.
With a keyring (`KVPOOL_AUTH_FILE`) a worker derives each tenant's salt itself (reference_worker/tenants.py).
"""

from __future__ import annotations

import click

from kvpool.cli.service_options import config_options, settings_from


def _refuse_salt_on_argv(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is not None:
        raise click.UsageError("--tenant-salt is not accepted: a salt on the command line is visible to every local "
                               "user (ps). Put it in a file readable only by you and set KVPOOL_TENANT_SALT_FILE=FILE "
                               "(or KVPOOL_TENANT_SALT).")


@click.command()
@config_options
@click.option("--role", type=click.Choice(["prefill", "decode", "both"]), required=True,
              help="prefill: prompt in, first token + KV handle out; decode: handle in, tokens out; "
                   "both: colocated, decode-priority scheduling.")
@click.option("--pool", help="Pool address HOST:PORT (default: [pool] master); 'none': a colocated worker that "
                             "shares nothing (the baseline of what the pool costs).")
@click.option("--host", help="Address to listen on (default 127.0.0.1).")
@click.option("--port", type=int, help="HTTP port (default 0: any free port).")
@click.option("--router", help="Register with this router URL (POST URL/admin/workers, repeated every 5 s) and tell "
                               "it on drain.")
@click.option("--kv-codec", metavar="CODEC",
              help="How KV chunks are stored in the pool: none (lossless, the default), int8, fp8, or one of those "
                   "+ '+zstd' (`kvpool bench codec` measures what each costs). Part of the namespace: workers of "
                   "different codecs never read each other's chunks.")
@click.option("--local-cache", help="Size of this worker's own prefix cache in front of the pool (default 512MiB; "
                                    "0 disables).")
@click.option("--max-batch", type=int, help="Most sequences in a decode batch (default 32).")
@click.option("--prefill-chunk-tokens", type=int,
              help="Prefill at most this many tokens between decode steps (default: whole prompt on 'prefill'; "
                   "512 on 'both' and 'decode').")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), help="Model dtype (default float32).")
@click.option("--threads", type=click.IntRange(min=1), metavar="N",
              help="torch intra-op threads (default: one per core of --cpus, else torch's own choice).")
@click.option("--cpus", metavar="LIST",
              help="Run on these cores only, e.g. 0 or 2-3 (sched_setaffinity); torch gets one thread per core.")
@click.option("--ready-file", type=click.Path(dir_okay=False),
              help="Write {url, port, pid, role} here (JSON) once serving: for launchers.")
@click.option("--tenant-salt", expose_value=False, hidden=True, callback=_refuse_salt_on_argv,
              help="Refused: use KVPOOL_TENANT_SALT_FILE.")
def worker(config_file, sets, role, kv_codec, ready_file, **flags) -> None:
    """Serve a reference worker's HTTP API (/v1/prefill, /v1/decode, /v1/generate, /load, /metrics).

    SIGTERM or SIGINT drains first (503 to new requests, open streams finish), then exits 0.
    """
    from reference_worker.server import serve

    settings = settings_from(config_file, sets, pool={"kv_codec": kv_codec}, worker=flags)
    serve(settings, role, ready_file=ready_file,
          on_ready=lambda url: click.echo(f"kvpool worker ({role}) serving at {url}"))
