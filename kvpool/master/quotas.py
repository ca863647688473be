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
it lands until the drained node leaves. The account follows the table itself (`TenantObjects`),
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

from kvpool.contract import SCOPE_SEP
from kvpool.errors import QuotaExceeded
from kvpool.security.tenancy import tenant_of


class _ChargedReplicas(dict):
    """An object's replicas (node id -> `Replica`) that add and take back `size` bytes in its
    tenant's use cell as replicas come and go; `cell` is None once the object left the table."""

    __slots__ = ("cell", "size")

    def __init__(self, replicas: dict, cell: list[int], size: int):
        super().__init__(replicas)
        self.cell: list[int] | None = cell
        self.size = size

    def __setitem__(self, node_id: str, replica: Any) -> None:
        if node_id not in self and self.cell is not None:
            self.cell[0] += self.size
        dict.__setitem__(self, node_id, replica)

    def __delitem__(self, node_id: str) -> None:
        dict.__delitem__(self, node_id)
        if self.cell is not None:
            self.cell[0] -= self.size

    def pop(self, node_id: str, *default: Any) -> Any:
        if node_id not in self:
            if default:
                return default[0]
            raise KeyError(node_id)
        replica = self[node_id]
        del self[node_id]
        return replica


class TenantObjects(dict):
    """The master's object table (key -> `ObjectEntry`), keeping `usage[tenant] = [bytes, keys]`
    of its entries (module doc). Entries enter only by `table[key] = entry` and leave only by
    `del`, `pop` or `clear`; an entry's `replicas` is wrapped on entry so its changes count."""

    def __init__(self) -> None:
        super().__init__()
        self.usage: dict[str, list[int]] = {}

    def __setitem__(self, key: str, obj: Any) -> None:
        if key in self:
            del self[key]
        sep = key.find(SCOPE_SEP)  # `tenant_of`, inline: once per put
        tenant = key[:sep] if sep > 0 else ""
        cell = self.usage.get(tenant)
        if cell is None:
            cell = self.usage[tenant] = [0, 0]
        replicas = obj.replicas = _ChargedReplicas(obj.replicas, cell, obj.size)
        cell[0] += obj.size * len(replicas)
        cell[1] += 1
        dict.__setitem__(self, key, obj)

    def __delitem__(self, key: str) -> None:
        obj = dict.pop(self, key)
        replicas = obj.replicas
        cell, replicas.cell = replicas.cell, None
        cell[0] -= obj.size * len(replicas)
        cell[1] -= 1
        if cell[1] == 0:
            self.usage.pop(tenant_of(key), None)

    def pop(self, key: str, *default: Any) -> Any:
        if key not in self:
            if default:
                return default[0]
            raise KeyError(key)
        obj = self[key]
        del self[key]
        return obj

    def clear(self) -> None:
        for obj in self.values():
            obj.replicas.cell = None
        super().clear()
        self.usage.clear()

    def setdefault(self, *args: Any) -> Any:  # would bypass the account
        raise TypeError("TenantObjects: assign entries with table[key] = entry")

    update = setdefault

    def used(self, tenant: str) -> tuple[int, int]:
        """(bytes, keys) `tenant` holds in the pool."""
        cell = self.usage.get(tenant)
        return (cell[0], cell[1]) if cell is not None else (0, 0)


class QuotaTable:
    """Each tenant's pool-wide quota, tenant -> (quota_bytes, quota_keys) from the keyring (0: no
    limit; a tenant not named, or no keyring: none). Its use is the object table's own account."""

    def __init__(self, limits: dict[str, tuple[int, int]] | None = None):
        self.limits = dict(limits or {})

    def check(self, objects: Any, key: str, size: int, replicas: int) -> None:
        """`QuotaExceeded` when a new object of `key` on `replicas` nodes takes its tenant past its
        quota; `objects`: the table, with `used(tenant)`."""
        if self.limits:
            check_quota(self.limits, objects, key, size, replicas)

    def of(self, tenant: str) -> tuple[int, int]:
        return self.limits.get(tenant, (0, 0))


def check_quota(quotas: dict[str, tuple[int, int]], objects: Any, key: str, size: int, replicas: int) -> None:
    """Raise `QuotaExceeded` when a new object of `size` bytes on `replicas` nodes under `key`
    takes its tenant past a quota of `quotas` (tenant -> (bytes, keys); 0: none); `objects` (the
    object table, or a `TenantObjects`) gives the tenant's use."""
    tenant = tenant_of(key)
    quota = quotas.get(tenant)
    if quota is None:
        return
    max_bytes, max_keys = quota
    used_bytes, used_keys = objects.used(tenant)
    adding = size * replicas
    if max_bytes and used_bytes + adding > max_bytes:
        raise QuotaExceeded(f"tenant {tenant!r} would hold {used_bytes + adding} bytes in the pool "
                            f"({used_bytes} now, every replica counted), over its quota of {max_bytes} "
                            "(quota_bytes in the keyring); remove some of its keys")
    if max_keys and used_keys + 1 > max_keys:
        raise QuotaExceeded(f"tenant {tenant!r} holds {used_keys} keys in the pool, its quota (quota_keys in "
                            "the keyring); remove some of its keys")
