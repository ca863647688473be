"""`kvpool admin ...`: inspect and operate a running pool through its REST admin API.

Thin: settings (file, `KVPOOL_*`, flags) -> `AdminClient` -> a table, or JSON with `--json`.
Errors are the typed ones the API returns, printed as one line by `kvpool.cli.main`.
"""

from __future__ import annotations

import json
from typing import Any

import click

from kvpool.cli.service_options import config_options
from kvpool.errors import InvalidArgument


class _Ctx:
    def __init__(self, url: str, token: str | None, as_json: bool, auth_file: str | None = None):
        self.url, self.token, self.as_json, self.auth_file = url, token, as_json, auth_file

    def client(self):
        from kvpool.admin.client import AdminClient

        return AdminClient(self.url, self.token)


def _emit(ctx: _Ctx, doc: Any, table: Any = None) -> None:
    if ctx.as_json or table is None:
        click.echo(json.dumps(doc, indent=None if ctx.as_json else 2, sort_keys=True, default=str))
        return
    from rich.console import Console

    Console().print(table)


def _size(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return str(n)
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= factor:
            return f"{n / factor:.1f} {unit}"
    return f"{int(n)} B"


@click.group()
@click.option("--url", envvar="KVPOOL_ADMIN_URL",
              help="Admin API base URL [default: http://<host>:<admin_port> from settings].")
@click.option("--token-file", type=click.Path(dir_okay=False),
              help="File holding the API's bearer token [default: settings' admin_token_file / admin_token, "
                   "KVPOOL_ADMIN_TOKEN_FILE, KVPOOL_ADMIN_TOKEN, else with no keyring the user's own admin.token of "
                   "~/.config/kvpool]. Never on the command line: argv is public.")
@click.option("--principal", metavar="NAME",
              help="Ask as this tenant principal of the keyring (KVPOOL_AUTH_FILE): its own token is derived from "
                   "its secret, and the API shows only its keys and its use and quota.")
@config_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@click.pass_context
def admin(ctx: click.Context, url: str | None, token_file: str | None, principal: str | None,
          config_file: str | None, sets: tuple[str, ...], as_json: bool) -> None:
    """Inspect and operate a running pool (nodes, stats, keys, eviction, drain, config)."""
    from kvpool.cli.service_options import settings_from
    from kvpool.config import read_secret_file

    if token_file and principal:
        raise InvalidArgument("give --token-file (the admin) or --principal (a tenant), not both")
    token = read_secret_file(token_file, "--token-file") if token_file else None
    settings = settings_from(config_file, sets, admin_token=token)
    pool, security = settings.pool, settings.security
    if url is None:
        if not pool.admin_port:
            raise InvalidArgument("the admin API is disabled (admin_port = 0); pass --url")
        url = f"http://{pool.host}:{pool.admin_port}"
    token = security.admin_token
    if token is None and not principal and not security.auth_file:  # the user's own (kvpool.security.local)
        from kvpool.security.local import local_token

        token = local_token("admin")
    ctx.obj = _Ctx(url, _tenant_token(principal, security.auth_file) if principal else token, as_json,
                   security.auth_file)


def _tenant_token(principal: str, auth_file: str | None) -> str:
    """The admin-API token of tenant `principal` (`kvpool.security.keyring.admin_api_token`)."""
    from kvpool.security.keyring import admin_api_token, load_keyring

    keyring = load_keyring(auth_file)
    if keyring is None:
        raise InvalidArgument("--principal needs the keyring that holds it: set KVPOOL_AUTH_FILE")
    entry = keyring.entries.get(principal)
    if entry is None or not entry.principal.tenant:
        raise InvalidArgument(f"keyring {keyring.source} has no tenant principal {principal!r}")
    return admin_api_token(entry.secret)


@admin.command()
@click.pass_obj
def nodes(ctx: _Ctx) -> None:
    """List store nodes: state, address, capacity and use, heartbeat age."""
    with ctx.client() as c:
        items = c.nodes()
    rows = [(str(n.get("node_id", n.get("id", "?"))), str(n.get("state", "")), str(n.get("address", "")),
             _size(n.get("capacity_bytes", "")), _size(n.get("used_bytes", "")), str(n.get("objects", "")),
             f"{n['heartbeat_age_s']:.1f} s" if isinstance(n.get("heartbeat_age_s"), (int, float)) else "")
            for n in items]
    columns = ("node", "state", "address", "capacity", "used", "objects", "heartbeat age")
    _emit(ctx, items, _table(f"nodes ({len(items)})", columns, rows))


def _table(title: str, columns: tuple[str, ...], rows: Any) -> Any:
    from rich.table import Table

    table = Table(title=title)
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*row)
    return table


def _rate(value: Any) -> str:
    return f"{100 * value:.1f}%" if isinstance(value, (int, float)) else "-"


def _with_hit_rates(tiers: dict[str, Any]) -> None:
    """Each tier's hit rate: the reads it served over the reads that reached it (a DRAM miss
    goes on to SSD, so SSD's rate is over DRAM's misses)."""
    for t in tiers.values():
        if isinstance(t, dict) and isinstance(t.get("hits"), (int, float)) and isinstance(t.get("misses"), (int, float)):
            reads = t["hits"] + t["misses"]
            t["hit_rate"] = t["hits"] / reads if reads else None


def _tier_table(tiers: dict[str, Any]) -> Any:
    fields = sorted({f for t in tiers.values() if isinstance(t, dict) for f in t} - {"hit_rate"})
    sizes = {f for f in fields if "byte" in f or f in ("capacity", "used")}
    rows = ([name, _rate(t.get("hit_rate")), *[_size(t.get(f)) if f in sizes else str(t.get(f, ""))
                                               for f in fields]] for name, t in tiers.items())
    return _table("pool tiers", ("tier", "hit rate", *fields), rows)


@admin.command()
@click.option("--router", "router_url", envvar="KVPOOL_ROUTER_URL", metavar="URL",
              help="Ask this router instead (its GET /admin/stats): prompt tokens by source (worker cache, pool "
                   "DRAM, pool SSD, computed) over its workers, per tenant, and the pool's tiers.")
@click.pass_obj
def stats(ctx: _Ctx, router_url: str | None) -> None:
    """Hit rates per tier; pool totals and, per tier: capacity, used, hits, misses, evictions, bytes in/out."""
    if router_url:
        _router_stats(ctx, router_url)
        return
    with ctx.client() as c:
        doc = c.stats()
    tiers = doc.get("tiers") if isinstance(doc, dict) else None
    if not isinstance(tiers, dict) or not tiers:
        _emit(ctx, doc)
        return
    _with_hit_rates(tiers)
    _emit(ctx, doc, _tier_table(tiers))
    if not ctx.as_json:
        totals = {k: v for k, v in doc.items() if k != "tiers" and not isinstance(v, (dict, list))}
        click.echo("  ".join(f"{k}={v}" for k, v in sorted(totals.items())))


def _router_stats(ctx: _Ctx, url: str) -> None:
    from rich.console import Console

    from kvpool.admin.client import HttpClient
    from kvpool.security.http_guard import internal_headers
    from kvpool.security.keyring import load_keyring

    headers = internal_headers(load_keyring(ctx.auth_file))
    with HttpClient(url, what="the router", timeout=30, headers=headers) as router:
        doc = router.request("GET", "/admin/stats").json()
    if ctx.as_json:
        _emit(ctx, doc)
        return
    console = Console()
    prompt = doc["prompt"]
    looked = prompt["lookup_tokens"]
    rows = ((source, str(n), _rate(n / looked if looked else None), str(prompt["objects"][source]))
            for source, n in prompt["tokens"].items())
    console.print(_table(f"prompt tokens by source ({prompt['requests']} prefills over the router's workers)",
                         ("source", "tokens", "share", "chunks"), rows))
    click.echo(f"hit ratio (tokens not computed): {_rate(prompt['hit_ratio'])}")
    tenants = {t: d for t, d in doc["tenants"].items() if t}
    if tenants:
        rows = ((tenant, _rate(d["hit_ratio"]), *[str(v) for v in d["tokens"].values()])
                for tenant, d in tenants.items())
        console.print(_table("per tenant", ("tenant", "hit ratio", *prompt["tokens"]), rows))
    if doc["pool_tiers"]:
        console.print(_tier_table(doc["pool_tiers"]))
    for source in doc["sources"]:
        if not source["ok"]:
            click.echo(f"not read: {source['name']} ({source['error']})", err=True)


@admin.command()
@click.option("--bytes", "target", help="Free at least this much by the eviction policy (e.g. 512MiB).")
@click.option("--key", "keys", multiple=True, help="Evict this key (repeatable).")
@click.pass_obj
def evict(ctx: _Ctx, target: str | None, keys: tuple[str, ...]) -> None:
    """Evict objects: by policy until --bytes are freed, or exactly the given --key(s)."""
    from kvpool.config import parse_size

    if (target is None) == (not keys):
        raise InvalidArgument("give either --bytes SIZE or one or more --key KEY")
    with ctx.client() as c:
        result = c.evict(target_bytes=parse_size(target) if target else None, keys=list(keys) or None)
    _emit(ctx, result)


@admin.command()
@click.option("--prefix", default="", help="Only keys starting with this.")
@click.option("--limit", default=100, show_default=True, type=click.IntRange(1, 10_000))
@click.pass_obj
def keys(ctx: _Ctx, prefix: str, limit: int) -> None:
    """List complete keys (at most --limit)."""
    with ctx.client() as c:
        found = c.keys(prefix, limit)
    if ctx.as_json:
        _emit(ctx, found)
    else:
        for k in found:
            click.echo(k)


@admin.command()
@click.option("--set", "changes", multiple=True, metavar="FIELD=VALUE",
              help="Change a setting at run time (repeatable); VALUE is JSON or a plain string.")
@click.pass_obj
def config(ctx: _Ctx, changes: tuple[str, ...]) -> None:
    """Show the master's configuration, or change fields with --set."""
    patch: dict[str, Any] = {}
    for item in changes:
        field, sep, raw = item.partition("=")
        if not sep or not field:
            raise InvalidArgument(f"--set expects FIELD=VALUE, got {item!r}")
        try:
            patch[field.strip()] = json.loads(raw)
        except ValueError:
            patch[field.strip()] = raw
    with ctx.client() as c:
        _emit(ctx, c.patch_config(patch) if patch else c.config())


def _add_call(name: str, argument: str | None, help: str, confirm: str | None = None) -> None:
    """`kvpool admin NAME [ARGUMENT]`: one `AdminClient` call (its method: NAME, dashes as
    underscores), its answer printed as JSON."""

    def call(ctx: _Ctx, **args: str) -> None:
        with ctx.client() as c:
            _emit(ctx, getattr(c, name.replace("-", "_"))(*args.values()))

    command = click.pass_obj(call)
    if confirm:
        command = click.confirmation_option(prompt=confirm)(command)
    if argument:
        command = click.argument(argument)(command)
    admin.command(name, help=help)(command)


for _args in (
    ("node", "node_id", "Show one node in full."),
    ("key", "key", "Show one object: size, state, replicas (node, tier), lease."),
    ("drain", "node_id", "Stop placing new objects on NODE_ID (its objects stay readable)."),
    ("undrain", "node_id", "Place new objects on NODE_ID again."),
    ("remove-node", "node_id", "Forget NODE_ID and drop its replicas from the index.",
     "Remove the node and drop its replicas from the index?"),
    ("health", None, "Check that the admin API answers."),
):
    _add_call(*_args)
