"""The admin face of the master (what the REST admin API calls), given the shared `MasterState`.

All methods are synchronous, thread-safe, and return plain JSON-able dicts/lists. An unknown
node id or key raises `KeyNotFound`; a bad argument raises `InvalidArgument`.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any, Callable, Sequence

from kvpool.contract import check_stored_key as check_key
from kvpool.errors import InvalidArgument, KeyNotFound
from kvpool.master.migration import Migration
from kvpool.master.state import MasterState
from kvpool.master.tables import COMPLETE, NODE_DRAINING, NODE_UP, PENDING

# Settings the admin API may change at run time, with their validators.
PATCHABLE: dict[str, Callable[[Any], bool]] = {
    "replicas": lambda v: isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 16,
    "put_timeout_s": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0,
    "lease_s": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0,
    "node_timeout_s": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0,
    "high_watermark": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1,
    "low_watermark": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1,
}



class AdminOps:
    def __init__(self, state: MasterState, migration: Migration):
        self.state = state
        self.migration = migration

    def nodes(self) -> list[dict]:
        with self.state.lock:
            return [self._node_doc_locked(n) for n in self.state.nodes]

    def node(self, node_id: str) -> dict:
        with self.state.lock:
            return self._node_doc_locked(self.state.nodes.require(node_id))

    def drain_node(self, node_id: str) -> dict:
        """Stop placing new objects on the node and copy what only it holds to other nodes
        (in the background); `pending_migration` counts down to 0, then it can leave."""
        with self.state.lock:
            node = self.state.nodes.set_state(node_id, NODE_DRAINING)
            return self._node_doc_locked(node)

    def _node_doc_locked(self, node: Any) -> dict:
        doc = node.to_dict(time.monotonic())
        doc["pending_migration"] = sum(1 for o in self.state.objects.values()
                                       if node.node_id in o.replicas and self.migration.stranded(o)) \
            if node.state == NODE_DRAINING else 0
        return doc

    def undrain_node(self, node_id: str) -> dict:
        with self.state.lock:
            node = self.state.nodes.set_state(node_id, NODE_UP)
            return node.to_dict(time.monotonic())

    def remove_node(self, node_id: str) -> dict:
        """Forget the node and its replicas; it may not register again under this id."""
        st = self.state
        with st.lock:
            info = st.nodes.require(node_id).to_dict(time.monotonic())
            st.drop_node_locked(node_id, "removed by an operator")
            st.nodes.banned.add(node_id)
            return info

    def stats(self) -> dict:
        st = self.state
        now = time.monotonic()
        with st.lock:
            tiers: dict[str, dict[str, int]] = {}
            for n in st.nodes:
                for tier, cap in n.capacity.items():
                    t = tiers.setdefault(tier, {"capacity_bytes": 0, "used_bytes": 0, "replicas": 0})
                    t["capacity_bytes"] += cap
            complete = pending = nbytes = leases = 0
            for obj in st.objects.values():
                if obj.state == PENDING:
                    pending += 1
                    continue
                complete += 1
                nbytes += obj.size
                leases += len(obj.leases)
                for r in obj.replicas.values():
                    t = tiers.setdefault(r.tier, {"capacity_bytes": 0, "used_bytes": 0, "replicas": 0})
                    t["used_bytes"] += obj.size
                    t["replicas"] += 1
            return {
                "leader": st.role.leader,
                "leader_address": st.role.leader_address,
                "recovering": st.role.recovering(now),
                "nodes": len(st.nodes),
                "nodes_up": sum(n.state == NODE_UP for n in st.nodes),
                "objects": complete,
                "pending": pending,
                "bytes": nbytes,
                "leases": leases,
                "tombstones": len(st.tombstones),  # removes remembered by key (`removal_memory_s`)
                "removal_horizon": st.tombstones.horizon,  # the generation below which they were forgotten
                "tiers": tiers,
                "totals": {"capacity_bytes": sum(n.total_capacity for n in st.nodes),
                           "used_bytes": sum(n.used for n in st.nodes)},
                "counters": dict(st.counters),
            }

    def tenant_stats(self, tenant: str) -> dict:
        """A tenant's use of the pool and its quota (0: none), as the master counts it for quotas
        (`kvpool.master.quotas`: bytes of every replica, pending puts included; keys)."""
        st = self.state
        with st.lock:
            used_bytes, used_keys = st.objects.used(tenant)
            quota_bytes, quota_keys = st.quotas.of(tenant)
        return {"tenant": tenant, "bytes": used_bytes, "keys": used_keys,
                "quota_bytes": quota_bytes, "quota_keys": quota_keys}

    def key_info(self, key: str) -> dict:
        check_key(key)
        now = time.monotonic()
        with self.state.lock:
            obj = self.state.objects.get(key)
            if obj is None:
                raise KeyNotFound(f"key {key!r} not found")
            active = obj.leased(now)
            return {"key": key, "size": obj.size, "state": "removing" if obj.removing else obj.state,
                    "replicas": [asdict(r) for r in obj.replicas.values()], "put_id": obj.put_id,
                    "lease": {"active": active, "count": len(obj.leases),
                              "expires_in_s": round(max(0.0, obj.lease_until() - now), 3)},
                    "created_at": obj.created_at, "idle_s": round(now - obj.last_access, 3)}

    def keys(self, prefix: str = "", limit: int = 1000) -> list[str]:
        """Complete keys starting with `prefix` (at most `limit`), for listing."""
        with self.state.lock:
            out = []
            for key, obj in self.state.objects.items():
                if obj.visible() and key.startswith(prefix):
                    out.append(key)
                    if len(out) >= limit:
                        break
            return out

    def evict(self, target_bytes: int | None = None, keys: Sequence[str] | None = None) -> dict:
        """Evict named keys, or least-recently-used unleased objects until `target_bytes` are freed."""
        st = self.state
        if target_bytes is None and keys is None:
            raise InvalidArgument("evict needs target_bytes or keys")
        if target_bytes is not None and (not isinstance(target_bytes, int) or target_bytes < 0):
            raise InvalidArgument(f"target_bytes must be a non-negative integer, got {target_bytes!r}")
        now = time.monotonic()
        evicted, freed, skipped = 0, 0, 0
        with st.lock:
            if keys is not None:
                for key in keys:
                    check_key(key)
                    obj = st.objects.get(key)
                    if obj is None or obj.state != COMPLETE or obj.removing:
                        continue
                    if obj.leased(now):
                        skipped += 1
                        continue
                    freed += obj.size * len(obj.replicas)
                    evicted += 1
                    st.delete_locked(obj)
            if target_bytes:
                for obj in sorted(st.objects.values(), key=lambda o: o.last_access):
                    if freed >= target_bytes:
                        break
                    if obj.state != COMPLETE or obj.removing or obj.leased(now):
                        continue
                    freed += obj.size * len(obj.replicas)
                    evicted += 1
                    st.delete_locked(obj)
            st.counters["evictions"] += evicted
        return {"evicted": evicted, "freed_bytes": freed, "skipped_leased": skipped}

    def config(self) -> dict:
        with self.state.lock:
            doc = self.state.settings.redacted()  # the configuration, no secret in it
            doc.update({k: getattr(self.state.tunables, k) for k in PATCHABLE})  # the values in force now
            return doc

    def patch_config(self, changes: dict) -> dict:
        """Change run-time settings (see `PATCHABLE`); anything else is an InvalidArgument."""
        if not isinstance(changes, dict):
            raise InvalidArgument("config patch must be an object")
        for name, value in changes.items():
            check = PATCHABLE.get(name)
            if check is None:
                raise InvalidArgument(f"{name!r} cannot be changed at run time (changeable: {sorted(PATCHABLE)})")
            if not check(value):
                raise InvalidArgument(f"invalid value for {name}: {value!r}")
        tunables = self.state.tunables
        low = changes.get("low_watermark", tunables.low_watermark)
        high = changes.get("high_watermark", tunables.high_watermark)
        if low > high:
            raise InvalidArgument(f"low_watermark ({low}) must not exceed high_watermark ({high})")
        with self.state.lock:
            for name, value in changes.items():
                setattr(tunables, name, value)
        return self.config()
