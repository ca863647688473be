"""`kvpool auth init`: make the secrets a secured deployment needs, as files (never argv).

    DIR/keyring.toml    principals `node` (masters, nodes, workers, the router), `admin`, and one
                        `tenant:<id>` per --tenant with a random secret and an OpenAI API key (0600)
    DIR/admin.token     the admin API's bearer token (KVPOOL_ADMIN_TOKEN_FILE) (0600)
    DIR/internal.token  the router <-> worker bearer token, derived from the node secret (0600):
                        for Prometheus or curl against workers' and the router's /admin, /metrics

DIR is created 0700; existing files are never overwritten without --force.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import click


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o600)  # whatever the umask
    os.replace(tmp, path)


def _toml_str(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


@click.group()
def auth() -> None:
    """Secrets for authenticated deployments (see docs/security.md)."""


@auth.command()
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Directory for keyring.toml, admin.token and internal.token (created 0700).")
@click.option("--tenant", "tenants", multiple=True, metavar="ID",
              help="A tenant (repeatable): its own principal, namespace salt, chunk MAC key and API key.")
@click.option("--force", is_flag=True, help="Replace files that exist (invalidates the old secrets).")
def init(out_dir: str, tenants: tuple[str, ...], force: bool) -> None:
    """Write a keyring with a node principal, an admin principal and one principal per --tenant
    (random secrets, one API key each), the admin API token and the internal HTTP token."""
    from kvpool.auth import Keyring, internal_http_token, parse_role

    if len(set(tenants)) != len(tenants):
        raise click.UsageError("a --tenant is given twice")
    for tenant in tenants:
        parse_role(f"tenant:{tenant}", f"--tenant {tenant!r}")
        if tenant in ("node", "admin"):
            raise click.UsageError(f"--tenant {tenant!r}: the names node and admin are taken")
    out = Path(out_dir)
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    node_secret = secrets.token_urlsafe(32)
    lines = ["# kvpool keyring (kvpool auth init). Keep it 0600; every service reads it through KVPOOL_AUTH_FILE.",
             "# A client that is a tenant may hold a keyring with only its own principal.", ""]
    entries = [("node", "node", node_secret, None), ("admin", "admin", secrets.token_urlsafe(32), None)]
    entries += [(t, f"tenant:{t}", secrets.token_urlsafe(32), f"sk-{t}-{secrets.token_urlsafe(24)}") for t in tenants]
    for name, role, secret, api_key in entries:
        lines += [f"[principals.{_toml_str(name)}]", f"role = {_toml_str(role)}", f"secret = {_toml_str(secret)}"]
        if api_key:
            lines.append(f"api_keys = [{_toml_str(api_key)}]")
        lines.append("")
    keyring_path, admin_path, internal_path = out / "keyring.toml", out / "admin.token", out / "internal.token"
    for path in (keyring_path, admin_path, internal_path):
        if path.exists() and not force:
            raise click.UsageError(f"{path} exists; pass --force to replace it (every service then needs the new one)")
    _write_private(keyring_path, "\n".join(lines))
    _write_private(admin_path, secrets.token_urlsafe(32) + "\n")
    _write_private(internal_path, internal_http_token(node_secret.encode()) + "\n")
    Keyring.load(keyring_path)  # what we wrote is what services accept

    click.echo(f"wrote {keyring_path} (principals: node, admin{''.join(', ' + t for t in tenants)})")
    click.echo(f"wrote {admin_path} (admin API bearer token)")
    click.echo(f"wrote {internal_path} (router <-> worker token, for Prometheus and curl)")
    if tenants:
        click.echo("\nOpenAI API keys (the router maps each to its tenant):")
        for name, _, _, api_key in entries[2:]:
            click.echo(f"  {name:<12} {api_key}")
    click.echo(f"""
Use it (every process of the deployment reads the same keyring):
  kvpool up --auth-file {keyring_path}
or, service by service:
  export KVPOOL_AUTH_FILE={keyring_path}
  export KVPOOL_ADMIN_TOKEN_FILE={admin_path}    # kvpool serve / master, and kvpool admin
  kvpool serve --host 0.0.0.0 ...                # non-loopback binds need the keyring (protected mode)
A tenant's own program holds a keyring with only its principal, or sets KVPOOL_PRINCIPAL=<tenant>.
Details: docs/security.md""")
