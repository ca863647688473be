"""`kvpool auth init`: make the secrets a secured deployment needs, as files (never argv).

    DIR/keyring.toml    principals `node` (masters and nodes), `admin`, and one `tenant:<id>` per
                        --tenant with a random secret and an OpenAI API key (0600): masters and
                        nodes hold it (they check every principal's handshake)
    DIR/tenants.keyring.toml  the tenants only (0600): the router's and the workers' (least
                        privilege: no node secret there; `kvpool auth keyring` cuts a worker's to
                        the tenants it serves)
    DIR/admin.token     the admin API's bearer token (KVPOOL_ADMIN_TOKEN_FILE) (0600)
    DIR/internal.token  the router <-> worker bearer token, derived from the node secret (0600):
                        for curl against workers' and the router's /admin
    DIR/metrics.token   the bearer token Prometheus presents (KVPOOL_METRICS_TOKEN_FILE) (0600): it
                        opens /metrics of nodes, masters, the router and workers, and nothing else

`kvpool auth etcd-certs --out DIR --san etcd`: etcd's TLS with client certificates (openssl):

    DIR/etcd-ca.crt, etcd-ca.key          a CA of its own (keep the key offline: it signs more)
    DIR/etcd-server.crt, etcd-server.key  etcd's certificate: DNS/IP names --san, localhost, 127.0.0.1
    DIR/etcd-client.crt, etcd-client.key  the certificate masters, nodes, workers and the router present

`kvpool auth keyring --from FILE --principal NAME ... --out FILE`: a keyring of only those
principals (a worker that serves some tenants, a tenant's own program).

DIR is created 0700; keys are 0600; existing files are never overwritten without --force.
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path

import click


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o600)  # whatever the umask
    os.replace(tmp, path)


def _out_dir(out_dir: str, files: tuple[str, ...], force: bool) -> Path:
    """`out_dir`, made 0700; refused when one of `files` is in it already and not `force`."""
    out = Path(out_dir)
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    for name in files:
        if (out / name).exists() and not force:
            raise click.UsageError(f"{out / name} exists; pass --force to replace it "
                                   "(every service then needs the new one)")
    return out


@click.group()
def auth() -> None:
    """Secrets for authenticated deployments (see docs/security.md)."""


@auth.command()
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Directory for keyring.toml, admin.token, internal.token and metrics.token (created 0700).")
@click.option("--tenant", "tenants", multiple=True, metavar="ID",
              help="A tenant (repeatable): its own principal, namespace salt, chunk MAC key and API key.")
@click.option("--force", is_flag=True, help="Replace files that exist (invalidates the old secrets).")
def init(out_dir: str, tenants: tuple[str, ...], force: bool) -> None:
    """Write a keyring with a node principal, an admin principal and one principal per --tenant
    (random secrets, one API key each), the admin API token and the internal HTTP token."""
    from kvpool.security.keyring import Keyring, internal_http_token, parse_role

    if len(set(tenants)) != len(tenants):
        raise click.UsageError("a --tenant is given twice")
    for tenant in tenants:
        parse_role(f"tenant:{tenant}", f"--tenant {tenant!r}")
        if tenant in ("node", "admin"):
            raise click.UsageError(f"--tenant {tenant!r}: the names node and admin are taken")
    out = _out_dir(out_dir, ("keyring.toml", "tenants.keyring.toml", "admin.token", "internal.token",
                             "metrics.token"), force)
    node_secret = secrets.token_urlsafe(32)
    doc = {"node": {"role": "node", "secret": node_secret}, "admin": {"role": "admin", "secret": secrets.token_urlsafe(32)}}
    for t in tenants:
        doc[t] = {"role": f"tenant:{t}", "secret": secrets.token_urlsafe(32), "api_keys": [f"sk-{t}-{secrets.token_urlsafe(24)}"]}
    ring = Keyring.from_dict({"principals": doc})
    keyring_path, admin_path, internal_path = out / "keyring.toml", out / "admin.token", out / "internal.token"
    metrics_path, tenants_path = out / "metrics.token", out / "tenants.keyring.toml"
    _write_private(keyring_path, ring.to_toml(
        "kvpool keyring (kvpool auth init): every principal. Masters and nodes hold it (KVPOOL_AUTH_FILE), 0600.\n"
        "The router and workers hold tenants.keyring.toml; a tenant's program a keyring of its own principal."))
    if tenants:
        _write_private(tenants_path, ring.subset(list(tenants)).to_toml(
            "kvpool keyring of the tenants only (kvpool auth init): the router's and the workers' (no node secret).\n"
            "A worker that serves some tenants: kvpool auth keyring --from keyring.toml --principal ID ... --out FILE"))
    _write_private(admin_path, secrets.token_urlsafe(32) + "\n")
    _write_private(internal_path, internal_http_token(node_secret.encode()) + "\n")
    _write_private(metrics_path, secrets.token_urlsafe(32) + "\n")
    Keyring.load(keyring_path)  # what we wrote is what services accept
    entries = [(t, None, None, doc[t]["api_keys"][0]) for t in tenants]

    click.echo(f"wrote {keyring_path} (principals: node, admin{''.join(', ' + t for t in tenants)})")
    if tenants:
        click.echo(f"wrote {tenants_path} (the tenants only: the router's and the workers' keyring)")
    click.echo(f"wrote {admin_path} (admin API bearer token)")
    click.echo(f"wrote {internal_path} (router <-> worker token, for curl)")
    click.echo(f"wrote {metrics_path} (Prometheus's bearer token: /metrics only)")
    if tenants:
        click.echo("\nOpenAI API keys (the router maps each to its tenant):")
        for name, _, _, api_key in entries:
            click.echo(f"  {name:<12} {api_key}")
    click.echo(f"""
Use it (on one machine every process may read the whole keyring):
  kvpool up --auth-file {keyring_path}
or, service by service:
  export KVPOOL_AUTH_FILE={keyring_path}           # masters and nodes: every principal
  export KVPOOL_ADMIN_TOKEN_FILE={admin_path}    # kvpool serve / master, and kvpool admin
  export KVPOOL_METRICS_TOKEN_FILE={metrics_path} # every service's /metrics (a node's needs it)
  kvpool serve --host 0.0.0.0 ...                # non-loopback binds need the keyring (protected mode)
  # the router and workers: the tenants only, and the internal token (no node secret)
  KVPOOL_AUTH_FILE={tenants_path} KVPOOL_INTERNAL_TOKEN_FILE={internal_path} kvpool router ...
A tenant's own program holds a keyring with only its principal, or sets KVPOOL_PRINCIPAL=<tenant>.
Details: docs/security.md""")


@auth.command()
@click.option("--from", "source", required=True, type=click.Path(dir_okay=False, exists=True),
              help="The keyring to take principals from (e.g. keyring.toml of kvpool auth init).")
@click.option("--principal", "names", multiple=True, required=True, metavar="NAME",
              help="A principal to keep (repeatable).")
@click.option("--out", "out_file", required=True, type=click.Path(dir_okay=False), help="The keyring to write (0600).")
@click.option("--force", is_flag=True, help="Replace the file if it exists.")
def keyring(source: str, names: tuple[str, ...], out_file: str, force: bool) -> None:
    """Write a keyring of only some principals: what one role's processes should hold (a worker
    that serves tenants acme and beta: --principal acme --principal beta)."""
    from kvpool.security.keyring import Keyring

    out = Path(out_file)
    if out.exists() and not force:
        raise click.UsageError(f"{out} exists; pass --force to replace it")
    ring = Keyring.load(source).subset(list(dict.fromkeys(names)))
    _write_private(out, ring.to_toml(f"kvpool keyring: {', '.join(ring.entries)} (kvpool auth keyring, from {source})"))
    Keyring.load(out)
    click.echo(f"wrote {out} (principals: {', '.join(ring.entries)})")


ETCD_FILES = ("etcd-ca.crt", "etcd-ca.key", "etcd-server.crt", "etcd-server.key", "etcd-client.crt", "etcd-client.key")
# etcd's JSON gateway (which kvpool speaks) dials etcd's own gRPC port presenting the server
# certificate as a client certificate, so with --client-cert-auth the server certificate needs
# clientAuth as well as serverAuth.
LEAF_EXT = ("basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
            "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n")


def _san(names: tuple[str, ...]) -> str:
    entries = []
    for name in dict.fromkeys((*names, "localhost", "127.0.0.1")):
        try:
            entries.append(f"IP:{ipaddress.ip_address(name)}")
        except ValueError:
            if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?", name):
                raise click.UsageError(f"--san {name!r}: not a host name or an IP address") from None
            entries.append(f"DNS:{name}")
    return ",".join(entries)


def _openssl(args: list[str], cwd: Path) -> None:
    r = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise click.ClickException(f"openssl {args[0]} failed: {r.stderr.strip()[-500:]}")


def make_etcd_certs(out: Path, sans: tuple[str, ...], days: int) -> None:
    """CA, server and client certificates and keys (EC P-256) in `out`, keys 0600, via openssl.
    Made in a private temporary directory inside `out`, then moved into place."""
    work = Path(tempfile.mkdtemp(prefix=".etcd-certs.", dir=out))
    try:
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        _openssl(["req", "-x509", *ec, "-days", str(days), "-subj", "/CN=kvpool-etcd-ca",
                  "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
                  "-keyout", "etcd-ca.key", "-out", "etcd-ca.crt"], work)
        server_ext = f"extendedKeyUsage=serverAuth,clientAuth\nsubjectAltName={_san(sans)}\n"
        leaves = (("etcd-server", "kvpool-etcd", server_ext), ("etcd-client", "kvpool-node", "extendedKeyUsage=clientAuth\n"))
        for name, cn, ext in leaves:
            (work / f"{name}.ext").write_text(LEAF_EXT + ext)
            _openssl(["req", *ec, "-subj", f"/CN={cn}", "-keyout", f"{name}.key", "-out", f"{name}.csr"], work)
            _openssl(["x509", "-req", "-in", f"{name}.csr", "-CA", "etcd-ca.crt", "-CAkey", "etcd-ca.key",
                      "-CAcreateserial", "-days", str(days), "-extfile", f"{name}.ext", "-out", f"{name}.crt"], work)
        for name in ETCD_FILES:
            os.chmod(work / name, 0o600 if name.endswith(".key") else 0o644)
            os.replace(work / name, out / name)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@auth.command("etcd-certs")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Directory for the etcd-*.crt/.key files (created 0700).")
@click.option("--san", "sans", multiple=True, required=True, metavar="NAME",
              help="A name clients reach etcd by, DNS or IP (repeatable): etcd in compose, "
                   "kvpool-etcd and kvpool-etcd.kvpool.svc in Kubernetes. localhost and 127.0.0.1 are added.")
@click.option("--days", default=365, show_default=True, type=click.IntRange(1, 3650), help="Validity.")
@click.option("--force", is_flag=True, help="Replace files that exist (every service then needs the new ones).")
def etcd_certs(out_dir: str, sans: tuple[str, ...], days: int, force: bool) -> None:
    """Write a CA, etcd's server certificate and a client certificate for etcd's
    --client-cert-auth (kvpool reaches it as etcds://HOST:2379 with KVPOOL_ETCD_CA_FILE,
    KVPOOL_ETCD_CERT_FILE, KVPOOL_ETCD_KEY_FILE)."""
    if shutil.which("openssl") is None:
        raise click.ClickException("openssl is not installed (apt-get install openssl)")
    san = _san(sans)
    out = _out_dir(out_dir, ETCD_FILES, force)
    make_etcd_certs(out, sans, days)
    click.echo(f"wrote {', '.join(ETCD_FILES)} to {out} (server names: {san})")
    click.echo(f"""
etcd:   --cert-file {out}/etcd-server.crt --key-file {out}/etcd-server.key
        --client-cert-auth --trusted-ca-file {out}/etcd-ca.crt --listen-client-urls https://...
kvpool: --meta etcds://{sans[0]}:2379 with
  export KVPOOL_ETCD_CA_FILE={out}/etcd-ca.crt
  export KVPOOL_ETCD_CERT_FILE={out}/etcd-client.crt KVPOOL_ETCD_KEY_FILE={out}/etcd-client.key
Keep etcd-ca.key away from the services: with it anyone can mint a certificate etcd accepts.
Details: docs/security.md""")
