"""Whose KV a worker request touches: the tenant's namespace, pool principal, chunk MAC key and
handle key.

Without a keyring (the default) there is one `TenantKV`: the worker's namespace (salted with
`WorkerConfig.tenant_salt`, if any), its one pool client, unkeyed chunks and unsigned handles:
exactly the behaviour before tenants. A request naming a tenant is refused (the worker cannot
derive a tenant's salt without the keyring).

With a keyring (`KVPOOL_AUTH_FILE`), a worker serves several tenants. The router names the tenant
of each internal request in the `X-KVPool-Tenant` header (the request itself is authenticated by
the internal bearer token, checked in `app.py`); for tenant T the worker derives, from T's secret
in the keyring:
- the namespace salt `kvpool.security.keyring.tenant_salt(T, secret)`, which replaces the worker's own salt
  (the router salts the worker's `namespace_doc` the same way, so both hash prompts alike);
- the chunk MAC key `kvpool.security.keyring.chunk_mac_key(secret)`: T's chunks are MACed under it and only
  chunks MACed under it are read;
- the handle key `kvpool.security.keyring.handle_key(secret)`: T's handles are signed with it, and a decode
  worker accepts a handle only for the tenant it was signed for;
- a pool client that authenticates as T's principal, made on T's first request and kept (the
  pool scopes keys per tenant principal, so T's reads never see another tenant's objects).
A request without the header runs untenanted, as the principal the worker's own pool client uses
(`KVPOOL_PRINCIPAL`, else the keyring's node principal), with keys derived from that secret. A
worker whose keyring holds only tenants (least privilege: it has no secret of its own, and only its
own tenants' secrets) serves no untenanted request: each must name a tenant it holds.

Invariant: a `TenantKV` is built once per tenant and never changes; they are shared by requests
(their adapters and pool clients are thread-safe).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace
from typing import Any, Callable

from kvpool.security.keyring import Credential, Keyring, chunk_mac_key, handle_key, tenant_salt
from kvpool.errors import Forbidden, InvalidArgument
from kvpool.keys import Namespace

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TenantKV:
    """One tenant's view of the pool (tenant None: untenanted requests)."""

    tenant: str | None
    namespace: Namespace
    adapter: Any  # engine_adapters.hf.HFAdapter, on the tenant's pool client and MAC key
    handle_key: bytes | None  # None without a keyring: handles are neither signed nor checked
    pool: Any

    @property
    def reader(self) -> Any:
        return self.adapter.store.reader


class Tenants:
    """The `TenantKV` of each tenant, made on first use (see the module docstring)."""

    def __init__(self, model: Any, namespace: Namespace, pool: Any, keyring: Keyring | None,
                 on_adapter: Callable[[Any], None], connect: Callable[[Credential], Any]):
        self.model = model
        self.namespace = namespace
        self.keyring = keyring
        self._on_adapter = on_adapter
        self._connect = connect
        self._lock = threading.Lock()
        self._by_tenant: dict[str, TenantKV] = {}
        own = keyring.own_credential() if keyring is not None else None
        # a keyring of tenants only: no principal of its own, so no untenanted request
        self.untenanted = keyring is None or own is not None
        self.default = self._make(None, namespace, pool, own.secret if own is not None else None)

    def _make(self, tenant: str | None, namespace: Namespace, pool: Any, secret: bytes | None) -> TenantKV:
        from engine_adapters.hf import HFAdapter

        adapter = HFAdapter(pool, self.model, namespace, mac_key=chunk_mac_key(secret) if secret else None)
        self._on_adapter(adapter)
        return TenantKV(tenant, namespace, adapter, handle_key(secret) if secret else None, pool)

    def get(self, tenant: str | None) -> TenantKV:
        """The tenant's view; blocking on its first use (it connects to the pool): call it off the
        event loop. `Forbidden` for a tenant the keyring does not know."""
        if not tenant:
            if not self.untenanted:
                raise Forbidden("this worker holds only its tenants' credentials (its keyring has no principal of its "
                                f"own): a request must name one of its tenants {self.keyring.tenant_ids()} "
                                "(X-KVPool-Tenant)")
            return self.default
        if self.keyring is None:
            raise InvalidArgument("this worker has no keyring (KVPOOL_AUTH_FILE), so it serves no tenants: "
                                  "a request naming one (X-KVPool-Tenant) needs the keyring on the worker too")
        found = self._by_tenant.get(tenant)
        if found is not None:
            return found
        entry = self.keyring.tenant_entry(tenant)
        if entry is None:
            raise Forbidden(f"unknown tenant {tenant!r}: not served by this worker (its keyring holds "
                            f"{self.keyring.tenant_ids()})")
        with self._lock:
            found = self._by_tenant.get(tenant)
            if found is None:
                salted = replace(self.namespace, tenant_salt=tenant_salt(tenant, entry.secret))
                pool = self._connect(Credential(entry.principal.name, entry.secret))
                found = self._make(tenant, salted, pool, entry.secret)
                self._by_tenant[tenant] = found
                log.info("serving tenant %s (namespace %s, pool principal %s)", tenant, salted.hex(),
                         entry.principal.name)
        return found

    def all(self) -> list[TenantKV]:
        with self._lock:
            return [self.default, *self._by_tenant.values()]

    def close(self) -> None:
        """Close the tenants' own pool clients (the default one belongs to whoever passed it)."""
        with self._lock:
            made, self._by_tenant = list(self._by_tenant.values()), {}
        for kv in made:
            try:
                kv.pool.close()
            except Exception as exc:  # closing a dead connection must not mask a shutdown
                log.debug("closing tenant %s's pool client: %s", kv.tenant, exc)
