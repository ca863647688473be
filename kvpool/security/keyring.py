"""Who is asking: the keyring, principals and their roles, and the keys derived from secrets.

Authentication is off by default: with no keyring, every service listens on loopback only
(protected mode, `check_bind`) and serves anyone who reaches it, as before. With a keyring
(`KVPOOL_AUTH_FILE`, or `Settings.auth_file`), every port runs `transfer.auth`'s handshake
and every request is authorized against the proved principal.

Keyring file (TOML or JSON, mode 0600 or stricter, refused otherwise, as ssh refuses a readable
key):

    [principals.node]            # masters and nodes talk to each other as this
    role = "node"
    secret = "<at least 32 characters>"

    [principals.ops]
    role = "admin"
    secret = "..."

    [principals.acme]            # a tenant: its own keys only
    role = "tenant:acme"
    secret = "..."
    api_keys = ["sk-acme-..."]   # the OpenAI router maps these to the tenant
    quota_bytes = "8GiB"         # optional; 0 or absent: no quota
    quota_keys = 100000          # optional

Roles: `node` (every message: masters, nodes, and the pool's own housekeeping), `admin` (the
admin operations and any key), `tenant:<id>` (only keys of its own tenant; the pool scopes its
keys, so another tenant's key answers exactly as a miss). A client picks its principal by name
(`KVPOOL_PRINCIPAL`) from a keyring file that may hold only that principal.

A tenant's secret also derives, by HMAC with fixed labels, its chunk MAC key (`chunk_mac_key`)
and its namespace salt (`tenant_salt`): only holders of the tenant's secret can make either.
`admin_api_token` is its bearer token for its own view of the REST admin API.
`grant_key` (from the node principal's secret) signs the data-plane grants masters and nodes
hand to clients, and `ticket_key` the put tickets masters give writers for the nodes.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import stat
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool.config import current_settings, parse_size
from kvpool.errors import InvalidArgument, Unauthorized

ROLES = ("node", "admin", "tenant")
MIN_SECRET = 32
AUTH_FILE_ENV = "KVPOOL_AUTH_FILE"
PRINCIPAL_ENV = "KVPOOL_PRINCIPAL"


@dataclass(frozen=True)
class Principal:
    """A proved identity. `tenant` is set exactly when `role == "tenant"`."""

    name: str
    role: str
    tenant: str | None = None

    def __str__(self) -> str:
        return f"{self.name} ({self.role}{':' + self.tenant if self.tenant else ''})"


# Everyone, when authentication is off (and the peer of a same-uid unix socket where it is on:
# it could read this process's memory anyway).
ANYONE = Principal("anyone", "node")


@dataclass(frozen=True)
class Entry:
    principal: Principal
    secret: bytes
    api_keys: tuple[str, ...] = ()
    quota_bytes: int = 0
    quota_keys: int = 0


@dataclass(frozen=True)
class Credential:
    """What a client presents: a principal name and its secret."""

    principal: str
    secret: bytes = field(repr=False)


class Keyring:
    """Principals by name. Immutable once loaded; `load` re-reads the file for a new one."""

    def __init__(self, entries: dict[str, Entry], source: str = "<memory>"):
        self.entries = dict(entries)
        self.source = source
        self.local = False  # the per-user keyring made on first use (`kvpool.security.local`)
        self._by_api_key = {k: e for e in entries.values() for k in e.api_keys}

    # -- loading ---------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike) -> "Keyring":
        path = Path(path)
        try:
            st = path.stat()
        except OSError as exc:
            raise InvalidArgument(f"keyring {path}: {exc.strerror or exc}") from None
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise InvalidArgument(f"keyring {path} is readable by others (mode {stat.S_IMODE(st.st_mode):o}); "
                                  f"run: chmod 600 {path}")
        text = path.read_text()
        try:
            doc = json.loads(text) if text.lstrip().startswith("{") else tomllib.loads(text)
        except (ValueError, tomllib.TOMLDecodeError) as exc:
            raise InvalidArgument(f"keyring {path}: not valid TOML or JSON: {exc}") from None
        return cls.from_dict(doc, str(path))

    @classmethod
    def from_dict(cls, doc: dict[str, Any], source: str = "<memory>") -> "Keyring":
        principals = doc.get("principals")
        if not isinstance(principals, dict) or not principals:
            raise InvalidArgument(f"keyring {source}: needs a [principals.<name>] table")
        entries: dict[str, Entry] = {}
        for name, spec in principals.items():
            where = f"keyring {source}: principal {name!r}"
            if not isinstance(spec, dict):
                raise InvalidArgument(f"{where}: must be a table")
            unknown = set(spec) - {"role", "secret", "api_keys", "quota_bytes", "quota_keys"}
            if unknown:
                raise InvalidArgument(f"{where}: unknown field(s) {sorted(unknown)}")
            if not 0 < len(name.encode()) <= 255:
                raise InvalidArgument(f"{where}: name must be 1..255 bytes")
            role, tenant = parse_role(str(spec.get("role", "")), where)
            secret = str(spec.get("secret", ""))
            if len(secret) < MIN_SECRET:
                raise InvalidArgument(f"{where}: secret must be at least {MIN_SECRET} characters "
                                      "(`kvpool auth init` writes random ones)")
            api_keys = spec.get("api_keys", [])
            if not isinstance(api_keys, list) or not all(isinstance(k, str) and len(k) >= 16 for k in api_keys):
                raise InvalidArgument(f"{where}: api_keys must be a list of strings of at least 16 characters")
            if api_keys and role != "tenant":
                raise InvalidArgument(f"{where}: only a tenant principal has api_keys")
            entries[name] = Entry(Principal(name, role, tenant), secret.encode(), tuple(api_keys),
                                  parse_size(spec.get("quota_bytes", 0)), int(spec.get("quota_keys", 0)))
        if len({k for e in entries.values() for k in e.api_keys}) != sum(len(e.api_keys) for e in entries.values()):
            raise InvalidArgument(f"keyring {source}: an API key is listed twice")
        return cls(entries, source)

    # -- lookups ---------------------------------------------------------------------------
    def secret(self, name: str) -> bytes | None:
        entry = self.entries.get(name)
        return entry.secret if entry else None

    def principal(self, name: str) -> Principal:
        entry = self.entries.get(name)
        if entry is None:
            raise Unauthorized(f"unknown principal {name!r}")
        return entry.principal

    def credential(self, name: str | None = None) -> Credential:
        """The credential of `name` (default: `[security] principal`, KVPOOL_PRINCIPAL, else the
        keyring's only principal, else its `node` principal)."""
        name = name or current_settings().security.principal
        if not name:
            if len(self.entries) == 1:
                name = next(iter(self.entries))
            elif "node" in self.entries:
                name = "node"
            else:
                raise InvalidArgument(f"keyring {self.source} holds several principals: choose one with "
                                      f"{PRINCIPAL_ENV}=<name>")
        entry = self.entries.get(name)
        if entry is None:
            raise InvalidArgument(f"keyring {self.source} has no principal {name!r}")
        return Credential(name, entry.secret)

    def own_credential(self, name: str | None = None) -> Credential | None:
        """What a service of the deployment (the router, a worker) speaks as on its own behalf, for
        untenanted requests: `name`, else `[security] principal`, else the node principal; None when the
        keyring names none (one of tenants only: least privilege, such a service acts only for a
        tenant, as that tenant)."""
        name = name or current_settings().security.principal
        if name:
            return self.credential(name)
        if any(e.principal.role == "node" for e in self.entries.values()):
            return self.node_credential()
        return None

    def subset(self, names: list[str] | tuple[str, ...]) -> "Keyring":
        """A keyring of only the principals `names` (what one role's processes should hold)."""
        missing = [n for n in names if n not in self.entries]
        if missing:
            raise InvalidArgument(f"keyring {self.source} has no principal(s) {missing}")
        return Keyring({n: self.entries[n] for n in names}, f"{self.source} ({', '.join(names)})")

    def to_toml(self, header: str = "") -> str:
        """The keyring as a keyring file (`Keyring.load` reads it back as it was)."""
        q = json.dumps  # a JSON string is a TOML basic string
        lines = [f"# {line}" for line in header.splitlines()] + ([""] if header else [])
        for name, e in self.entries.items():
            role = f"tenant:{e.principal.tenant}" if e.principal.tenant else e.principal.role
            lines += [f"[principals.{q(name)}]", f"role = {q(role)}", f"secret = {q(e.secret.decode())}"]
            if e.api_keys:
                lines.append(f"api_keys = [{', '.join(q(k) for k in e.api_keys)}]")
            if e.quota_bytes:
                lines.append(f"quota_bytes = {e.quota_bytes}")
            if e.quota_keys:
                lines.append(f"quota_keys = {e.quota_keys}")
            lines.append("")
        return "\n".join(lines)

    def tenant_ids(self) -> list[str]:
        return sorted(e.principal.tenant for e in self.entries.values() if e.principal.tenant)

    def tenant_of_api_key(self, api_key: str) -> Entry | None:
        """The tenant entry an API key belongs to (constant-time per candidate), or None."""
        found = None
        for key, entry in self._by_api_key.items():
            if hmac.compare_digest(key.encode(), api_key.encode()):
                found = entry
        return found

    def tenant_entry(self, tenant: str) -> Entry | None:
        return next((e for e in self.entries.values() if e.principal.tenant == tenant), None)

    def node_credential(self) -> Credential:
        for name, entry in self.entries.items():
            if entry.principal.role == "node":
                return Credential(name, entry.secret)
        raise InvalidArgument(f"keyring {self.source} has no principal with role 'node' (masters and nodes use it)")


def parse_role(role: str, where: str = "role") -> tuple[str, str | None]:
    if role in ("node", "admin"):
        return role, None
    if role.startswith("tenant:") and role[len("tenant:"):].strip():
        tenant = role[len("tenant:"):].strip()
        if not all(c.isalnum() or c in "-_." for c in tenant) or len(tenant) > 64:
            raise InvalidArgument(f"{where}: a tenant id is 1..64 of letters, digits, '-', '_', '.'")
        return "tenant", tenant
    raise InvalidArgument(f"{where}: role must be 'node', 'admin' or 'tenant:<id>', got {role!r}")


def load_keyring(path: str | os.PathLike | None = None) -> Keyring | None:
    """The keyring at `path`, else at `[security] auth_file` (KVPOOL_AUTH_FILE), else None
    (authentication off)."""
    path = path or current_settings().security.auth_file or None
    return Keyring.load(path) if path else None


# -- derived keys ------------------------------------------------------------------------------
def _derive(secret: bytes, label: str) -> bytes:
    return hmac.new(secret, b"kvpool/" + label.encode(), hashlib.sha256).digest()


def chunk_mac_key(tenant_secret: bytes) -> bytes:
    """The key a tenant's chunks are MACed under (32 bytes)."""
    return _derive(tenant_secret, "chunk-mac/v1")


def tenant_salt(tenant: str, tenant_secret: bytes) -> str:
    """The namespace salt of a tenant: unguessable without its secret, stable across restarts."""
    return f"{tenant}/{_derive(tenant_secret, 'tenant-salt/v1').hex()[:32]}"


def engine_cache_salt(salt: str) -> str:
    """The `cache_salt` the router sends a vLLM server for a tenant whose `tenant_salt` is `salt`:
    the same salt in the characters vLLM accepts (no '/', '@', '\\', NUL; at most 128). A tenant
    id never holds ':', so distinct tenant salts stay distinct."""
    return salt.replace("/", ":")


def request_salt(configured: str, cache_salt: str | None) -> str:
    """The namespace salt of an engine request that carries `cache_salt` (vLLM's per-request
    salt), on an engine whose own salt is `configured`: `configured` itself without one (keys as
    before), else both, unambiguously, so two cache salts never share a key and none reaches
    another engine's configured namespace."""
    return json.dumps([configured, cache_salt]) if cache_salt else configured


def handle_key(secret: bytes) -> bytes:
    """The key a prefill worker signs KV handles with, and a decode worker checks them with: from
    the tenant's secret (or, for untenanted requests, the workers' own principal's)."""
    return _derive(secret, "kv-handle/v1")


def grant_key(node_secret: bytes) -> bytes:
    """The key masters and nodes sign data-plane grants with."""
    return _derive(node_secret, "grant/v1")


def ticket_key(node_secret: bytes) -> bytes:
    """The key masters sign put tickets with and nodes check them with (`kvpool.security.tickets`)."""
    return _derive(node_secret, "put-ticket/v1")


def admin_api_token(tenant_secret: bytes) -> str:
    """The bearer token a tenant presents to the REST admin API for its own view (its keys, its
    use and quota): derived, so the secret itself never goes on the wire, and the API knows it
    from the keyring with nothing else to distribute (`kvpool.security.admin_token`)."""
    return _derive(tenant_secret, "admin-api/v1").hex()


def internal_http_token(node_secret: bytes) -> str:
    """The bearer token the router presents to workers (and workers accept) when a keyring is
    configured: both hold the keyring, so nothing else needs distributing."""
    return _derive(node_secret, "http-internal/v1").hex()


# -- protected mode ----------------------------------------------------------------------------
def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, authenticated: bool, what: str) -> None:
    """Protected mode: refuse to listen on a non-loopback address without authentication."""
    if authenticated or is_loopback(host):
        return
    raise InvalidArgument(
        f"{what}: refusing to listen on {host} without authentication (protected mode). Anyone who can "
        f"reach that address could read and overwrite every tenant's KV. Either listen on 127.0.0.1, or "
        f"create a keyring (`kvpool auth init --out keyring.toml`) and set {AUTH_FILE_ENV}=keyring.toml "
        f"on every service (HTTP services also need their bearer tokens: see docs/security.md).")
