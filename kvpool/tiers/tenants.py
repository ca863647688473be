"""Tenants in one node's store: how much each holds, and its quota.

A tenant's keys are stored scoped, "<tenant>\x00<key>" (`kvpool.contract`, `kvpool.security.authz`);
unscoped keys (authentication off, admins, nodes) count as tenant "". Quotas come from the
keyring (`quota_bytes`, `quota_keys`). The master enforces them pool-wide on every put it plans
(`kvpool.master.quotas`); this per-node check (a tenant's use here is what this node's store
holds of it, reserved, stored (DRAM or SSD) or still being removed) is the backstop of a cluster
node against writes no master planned, and is off on the embedded node (why: the master's
module doc). Eviction fairness across tenants is `kvpool.tiers.policy.FairPolicy`.
"""

from __future__ import annotations

from kvpool.security.keyring import Keyring
from kvpool.errors import QuotaExceeded
from kvpool.security.tenancy import tenant_of


def tenant_quotas(keyring: Keyring | None) -> dict[str, tuple[int, int]]:
    """tenant -> (quota_bytes, quota_keys) of the keyring's tenants that have a quota."""
    if keyring is None:
        return {}
    return {e.principal.tenant: (e.quota_bytes, e.quota_keys) for e in keyring.entries.values()
            if e.principal.tenant and (e.quota_bytes or e.quota_keys)}


def check_quota(quotas: dict[str, tuple[int, int]], usage: dict[str, list[int]], key: str, size: int,
                where: str = "on this node") -> None:
    """Raise `QuotaExceeded` when storing `size` more bytes under `key` (a new key) takes its tenant
    past a quota of `quotas` (tenant -> (bytes, keys); 0: none); `usage`: tenant -> [bytes, keys]
    it holds `where` (a node's store, or the master's object table for the pool)."""
    tenant = tenant_of(key)
    quota = quotas.get(tenant)
    if quota is None:
        return
    max_bytes, max_keys = quota
    used_bytes, used_keys = usage.get(tenant, (0, 0))
    if max_bytes and used_bytes + size > max_bytes:
        raise QuotaExceeded(f"tenant {tenant!r} would hold {used_bytes + size} bytes {where} ({used_bytes} now), "
                            f"over its quota of {max_bytes} (quota_bytes in the keyring); remove some of its keys")
    if max_keys and used_keys + 1 > max_keys:
        raise QuotaExceeded(f"tenant {tenant!r} holds {used_keys} keys {where}, its quota (quota_keys in "
                            "the keyring); remove some of its keys")
