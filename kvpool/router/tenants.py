"""The router's tenants: who a request runs as, its chunk keys' namespace, and its pool client.

With a keyring whose tenants have `api_keys` (`api_keys` is then true and app.py admits only
requests bearing one), each request runs as the tenant its key belongs to. For tenant T:
- the namespace is the workers' namespace (`WorkerInfo.namespace_doc`, its canonical JSON) with
  `tenant_salt` replaced by `kvpool.security.keyring.tenant_salt(T, secret)`: the same salt a worker derives
  when the router names T in `X-KVPool-Tenant`, so both hash T's prompts into the same keys, and
  nobody without T's secret can compute them;
- `match_prefix` asks the pool as T's principal, through one client per tenant made on its first
  request (the pool scopes a tenant's keys, so T never matches another tenant's prefix).

Behind vLLM servers (`--engine vllm`, `via_cache_salt`), which take no tenant header and hold one
pool credential, tenant T is isolated by vLLM's own per-request salt instead:
- each request carries `cache_salt` = `kvpool.security.keyring.engine_cache_salt` of T's salt
  (`Tenant.cache_salt`, sent by vllm_backend.py), which the connector mixes into its configured
  salt (`kvpool.security.keyring.request_salt`): T's namespace is the servers' with that mixed salt;
- `match_prefix` asks the pool as the router's own principal (one client for every tenant): the
  servers write every tenant's chunks as their one principal, so T's principal would see none.

Invariants: a `Tenant` is made once per tenant id and only gains its namespace (once a worker
has described its namespace) and its pool client (once); only the event loop thread touches them.
Without a namespace description (a worker of an older version), a tenant has no namespace and
its prompts get no keys: nothing is matched, rather than another namespace's keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import xxhash

from kvpool.security.keyring import Credential, Entry, Keyring, engine_cache_salt, request_salt, tenant_salt
from kvpool.keys import NAMESPACE_PREFIX

log = logging.getLogger(__name__)


@dataclass
class Tenant:
    id: str
    credential: Credential | None  # its pool principal (None: the router's own)
    salt: str
    cache_salt: str | None = None  # behind vLLM: the `cache_salt` its requests carry
    namespace: bytes | None = None  # set once a worker has described its namespace
    pool: Any = None  # its pool client, made on its first match_prefix
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def salted_namespace(namespace_doc: dict[str, Any], salt: str) -> bytes:
    """The digest of `namespace_doc` (a `kvpool.keys.Namespace`'s canonical JSON, parsed) with its
    tenant salt replaced by `salt`: `Namespace.digest()` of the same namespace with that salt."""
    canonical = json.dumps({**namespace_doc, "tenant_salt": salt}, sort_keys=True, separators=(",", ":"),
                           ensure_ascii=False)
    return xxhash.xxh3_128_digest(NAMESPACE_PREFIX + canonical.encode())


def cache_salted_namespace(namespace_doc: dict[str, Any], cache_salt: str) -> bytes:
    """The namespace of requests carrying vLLM's `cache_salt` on servers of `namespace_doc`: their
    configured salt mixed with it, as the connector mixes them (`request_salt`)."""
    return salted_namespace(namespace_doc, request_salt(str(namespace_doc.get("tenant_salt", "")), cache_salt))


class Tenants:
    def __init__(self, keyring: Keyring | None, pool_address: str | None, *, via_cache_salt: bool = False):
        self.pool_address = pool_address
        self.via_cache_salt = via_cache_salt  # vLLM servers: salted by cache_salt, one pool principal
        self._shared = Tenant("", None, "")  # via_cache_salt: holds the router's own client, for every tenant
        # API keys are checked (app.py) exactly when some tenant of the keyring has one.
        self.api_keys = keyring is not None and any(e.api_keys for e in keyring.entries.values())
        self._namespace_doc: dict[str, Any] | None = None
        self._by_id: dict[str, Tenant] = {}

    def learn(self, namespace_doc: str) -> None:
        """The workers' namespace (`WorkerInfo.namespace_doc`; "" from a worker that sends none)."""
        self._namespace_doc = json.loads(namespace_doc) if namespace_doc else None

    def of(self, entry: Entry | None) -> Tenant | None:
        """The tenant of keyring `entry` (the one an API key named), or None for none."""
        if entry is None or entry.principal.tenant is None:
            return None
        tenant = self._by_id.get(entry.principal.tenant)
        if tenant is None:
            salt = tenant_salt(entry.principal.tenant, entry.secret)
            tenant = self._by_id[entry.principal.tenant] = Tenant(
                entry.principal.tenant, Credential(entry.principal.name, entry.secret), salt,
                engine_cache_salt(salt) if self.via_cache_salt else None)
        doc = self._namespace_doc
        if tenant.namespace is None and doc is not None:  # its own salt, or behind vLLM its cache_salt's
            tenant.namespace = (salted_namespace(doc, tenant.salt) if tenant.cache_salt is None
                                else cache_salted_namespace(doc, tenant.cache_salt))
        return tenant

    async def pool(self, tenant: Tenant) -> Any:
        """`tenant`'s pool client, connected as its principal on first use (behind vLLM: the
        router's own client, shared by every tenant)."""
        holder = self._shared if self.via_cache_salt else tenant
        if holder.pool is None:
            async with holder.lock:  # one client each, however many first requests race
                if holder.pool is None:
                    from kvpool.client import connect_async

                    holder.pool = await connect_async(self.pool_address, credential=holder.credential)
                    log.info("pool client for tenant %s connected as %s", holder.id or "(every tenant)",
                             holder.credential.principal if holder.credential else "the router")
        return holder.pool

    async def close(self) -> None:
        for pool in [t.pool for t in self._by_id.values()] + [self._shared.pool]:
            if pool is not None:
                with contextlib.suppress(Exception):
                    await pool.close()
