"""`kvpool worker`: a reference prefill / decode worker on the reference model.

The CLI is the one place in `kvpool` that sees `engine_adapters` (imported on use).

The tenant salt is a secret (it keys the namespace), so it never comes from argv, which any local
user reads in `ps`: `--tenant-salt-file FILE` or `KVPOOL_TENANT_SALT`. With a keyring
(`KVPOOL_AUTH_FILE`) a worker derives each tenant's salt itself (reference_worker/tenants.py).
"""

from __future__ import annotations

import os

import click

from kvpool.config import load_settings, parse_size

TENANT_SALT_ENV = "KVPOOL_TENANT_SALT"


def _refuse_salt_on_argv(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is not None:
        raise click.UsageError(f"--tenant-salt is no longer accepted: a salt on the command line is visible to "
                               f"every local user (ps). Put it in a file readable only by you and pass "
                               f"--tenant-salt-file FILE, or set {TENANT_SALT_ENV}.")


def read_tenant_salt(path: str | None) -> str:
    """The salt from `path` (stripped of surrounding whitespace), else from `KVPOOL_TENANT_SALT`, else ""."""
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                salt = f.read().strip()
        except OSError as exc:
            raise click.BadParameter(f"cannot read {path}: {exc.strerror or exc}", param_hint="--tenant-salt-file")
        if not salt:
            raise click.BadParameter(f"{path} is empty", param_hint="--tenant-salt-file")
        return salt
    return os.environ.get(TENANT_SALT_ENV, "")


@click.command()
@click.option("--role", type=click.Choice(["prefill", "decode", "both"]), required=True,
              help="prefill: prompt in, first token + KV handle out; decode: handle in, tokens out; "
                   "both: colocated, decode-priority scheduling.")
@click.option("--pool", "pool_address", help="Pool address HOST:PORT (default: settings 'master'); 'none': a colocated "
                                         "worker that shares nothing (the baseline of what the pool costs).")
@click.option("--host", help="Address to listen on (default 127.0.0.1).")
@click.option("--port", type=int, default=0, show_default=True, help="HTTP port (0: any free port).")
@click.option("--chunk-tokens", type=int, help="Tokens per KV chunk (default: settings, 256).")
@click.option("--local-cache", "local_cache", default="512MiB", show_default=True,
              help="Size of this worker's own prefix cache in front of the pool (0 disables).")
@click.option("--max-batch", type=int, default=32, show_default=True, help="Most sequences in a decode batch.")
@click.option("--max-kv-tokens", type=int, default=65536, show_default=True,
              help="Most KV tokens the decode batch may hold; later sequences wait to join.")
@click.option("--prefill-chunk-tokens", type=int,
              help="Prefill at most this many tokens between decode steps (default: whole prompt on 'prefill'; "
                   "512 on 'both' and 'decode').")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True)
@click.option("--tenant-salt-file", type=click.Path(dir_okay=False), metavar="FILE",
              help=f"File holding the salt that keeps this tenant's KV apart from others' (or set {TENANT_SALT_ENV}; "
                   "never on the command line). With a keyring, tenants' salts are derived per request instead.")
@click.option("--tenant-salt", expose_value=False, hidden=True, callback=_refuse_salt_on_argv,
              help="Removed: use --tenant-salt-file or KVPOOL_TENANT_SALT.")
@click.option("--kv-codec", default="none", show_default=True, metavar="CODEC",
              help="How KV chunks are stored in the pool: none (lossless), int8, fp8, or one of those + '+zstd' "
                   "(`kvpool bench codec` measures what each costs). Part of the namespace: workers of different "
                   "codecs never read each other's chunks.")
@click.option("--model-cache", type=click.Path(file_okay=False), envvar="KVPOOL_MODEL_CACHE",
              help="Where the converted model is cached (default ~/.cache/kvpool/models).")
@click.option("--ready-file", type=click.Path(dir_okay=False),
              help="Write {url, port, pid, role} here (JSON) once serving: for launchers.")
@click.option("--router", "router_url", metavar="URL",
              help="Register with this router (POST URL/admin/workers, repeated every 5 s) and tell it on drain.")
@click.option("--drain-timeout", type=float, default=60.0, show_default=True, metavar="SECONDS",
              help="On SIGTERM/SIGINT: refuse new work, wait at most this long for open streams, then exit.")
@click.option("--threads", type=click.IntRange(min=1), metavar="N",
              help="torch intra-op threads (default: one per core of --cpus, else torch's own choice).")
@click.option("--cpus", metavar="LIST",
              help="Run on these cores only, e.g. 0 or 2-3 (sched_setaffinity); torch gets one thread per core.")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), envvar="KVPOOL_CONFIG",
              help="Settings file (JSON or TOML).")
def worker(role, pool_address, host, port, chunk_tokens, local_cache, max_batch, max_kv_tokens,
           prefill_chunk_tokens, dtype, tenant_salt_file, kv_codec, model_cache, ready_file, router_url, drain_timeout, threads,
           cpus, config_file) -> None:
    """Serve a reference worker's HTTP API (/v1/prefill, /v1/decode, /v1/generate, /load, /metrics).

    SIGTERM or SIGINT drains first (503 to new requests, open streams finish), then exits 0.
    """
    from reference_worker.server import serve
    from reference_worker.service import WorkerConfig

    settings = load_settings(config_file, host=host, chunk_tokens=chunk_tokens)
    config = WorkerConfig(role=role, pool=pool_address or settings.master, chunk_tokens=settings.chunk_tokens,
                          local_cache_bytes=parse_size(local_cache), max_batch=max_batch,
                          max_kv_tokens=max_kv_tokens or None,
                          prefill_chunk_tokens=prefill_chunk_tokens, tenant_salt=read_tenant_salt(tenant_salt_file),
                          kv_codec=kv_codec)
    serve(config, host=settings.host, port=port, ready_file=ready_file, model_cache=model_cache, dtype=dtype,
          on_ready=lambda url: click.echo(f"kvpool worker ({role}) serving at {url}"), router=router_url,
          drain_timeout=drain_timeout, threads=threads, cpus=cpus)
