"""Tenant quotas, pool-wide: the master's object table keeps each tenant's use in step.

The master plans every put (`MasterService.put_start`), so it is the one place that sees a
tenant's whole footprint; it refuses a put past the tenant's `quota_bytes` / `quota_keys` (from
the keyring) with `QuotaExceeded` before placing it. A tenant's use is, over the objects of its
scoped keys ("<tenant>\\x00<key>", `kvpool.security.authz`; unscoped keys count as tenant ""):

    bytes = sum(size x replicas)   keys = number of objects

pending puts included (their planned replicas), removed objects still read under a lease
included until they go. Every replica counts because a replica takes that much room on its node:
counting each object once would let a tenant hold `replicas` x its quota by asking for more
replicas (up to one per node: the per-node gap this closes). A drain's copy counts from the time
it lands until the drained node leaves. The account follows the table itself (`ObjectTable.usage`),
so whatever takes an object or a replica out of it (remove, eviction, a reclaimed put, a lost
node, a node's own eviction reported in its heartbeat) gives its room back, and a new leader
rebuilds it from the nodes' re-reports as it rebuilds the table.

Writes the master did not plan are refused, not merely counted: with a keyring the master signs
each planned write's put ticket for its node (`kvpool.security.tickets`, after the quota check),
and a node whose master runs elsewhere takes a `NodeWrite` or `NodeReserve` only under a valid
ticket for that put, key, size and node, once (`kvpool.node.writes.Writes.plan`). So a tenant
sending writes with invented put ids straight to each node gains nothing (it used to hold up to
its quota on every node: N nodes x quota). Each node's store also checks the quota against what
it alone holds (`kvpool.tiers.tenants`), kept in cluster mode as a backstop, not a second count
(the two never add up: a node's share of a tenant is never more than the pool's, so the node's
check cannot refuse what the master's admitted, except for the moment a remove's queued removal
takes to reach the node). In embedded mode every write the node takes is planned by the master
in its own process, so the node's check would add only that spurious refusal and is off
(`StoreNode`).
"""

from __future__ import annotations

from typing import Any

from kvpool.tiers.tenants import check_quota


class QuotaTable:
    """Each tenant's pool-wide quota, tenant -> (quota_bytes, quota_keys) from the keyring (0: no
    limit; a tenant not named, or no keyring: none). Its use is the object table's own account."""

    def __init__(self, limits: dict[str, tuple[int, int]] | None = None):
        self.limits = dict(limits or {})

    def check(self, objects: Any, key: str, size: int, replicas: int) -> None:
        """`QuotaExceeded` when a new object of `key` on `replicas` nodes takes its tenant past its
        quota; `objects`: the table, with its `usage`."""
        if self.limits:
            check_quota(self.limits, objects.usage, key, size * replicas, "in the pool (every replica counted)")

    def of(self, tenant: str) -> tuple[int, int]:
        return self.limits.get(tenant, (0, 0))

