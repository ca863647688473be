"""The master's RPC face: wire messages -> `MasterService` calls -> wire replies.

Batch requests answer per item (`Err` in place of a result), so one bad key never fails the
others. `Admin` exposes the read-only admin methods by name (a fixed allow-list) for SDK users and tests.
Who may call which (`kvpool.security.authz` has already let the message through): node and admin
principals every method; a tenant only `keys` and `key_info`, over its own keys, named as it
names them (the listing is filtered by its scope and unscoped).
"""

from __future__ import annotations

import socket
from typing import Any

from kvpool.errors import Forbidden, InvalidArgument
from kvpool.messages import (PROTOCOL_VERSION, Admin, BatchResult, Bools, Count, Exists, Heartbeat,
                             HeartbeatReply, Hello, HelloReply, Info, Lookup, LookupReply, MatchPrefix, Ok, PutEnd,
                             PutPlans, PutStart, RegisterNode, Release, Remove, per_item)
from kvpool.contract import check_key
from kvpool.security.authz import unscope
from transfer.route import local_host_id

# Read-only on purpose: the RPC port has no token; changes go through the REST admin API.
_ADMIN_METHODS = {"nodes", "node", "stats", "key_info", "keys", "config"}
_TENANT_METHODS = {"key_info", "keys"}  # scoped to the tenant's own keys


def put_tokens(keys: list[str], token: int) -> list[int]:
    """Each key's put token (`MasterService.put_start`): a key twice in one batch is two puts, and
    only the first is the retry of an earlier attempt under `token`; the others get none (0)."""
    if len(keys) == 1 or not token:
        return [token] * len(keys)
    seen: set[str] = set()
    out = []
    for key in keys:
        out.append(0 if key in seen else token)
        seen.add(key)
    return out


def master_inline() -> dict[type, Any]:
    """The requests an RPC server may answer on its loop thread (`kvpool.rpc.loop`): reads of
    the tables (a lookup, its release) that hold the master's lock only briefly, and that lock
    never waits on the network (`kvpool.master.state`). The rest may (a put's room-making, a
    node's registration) and keeps a thread of its connection's own."""
    return dict.fromkeys((Lookup, Release, Exists, MatchPrefix))


def master_handlers(service: Any, node: Any = None) -> dict[type, Any]:
    """Handlers for `service` (a `MasterService`); `node`: the embedded node, if any."""

    def hello(msg: Hello, payload, conn) -> HelloReply:
        return HelloReply(version=PROTOCOL_VERSION, roles=["master", "node"] if node is not None else ["master"],
                          leader=service.leader, node=node.info() if node is not None else None,
                          max_object_bytes=service.max_object_bytes(), replicas=service.replicas,
                          hostname=socket.gethostname(), unix=service.unix_address, scope=conn.scope,
                          host_id=local_host_id())

    def put_start(msg: PutStart, payload, conn) -> PutPlans:
        replicas, writer = msg.replicas or None, msg.writer_node
        start = lambda key, size, token: service.put_start(key, size, replicas, writer, token)  # noqa: E731
        return PutPlans(per_item(start, msg.keys, msg.sizes, put_tokens(msg.keys, msg.token)))

    def put_end(msg: PutEnd, payload, conn) -> BatchResult:
        return BatchResult(per_item(service.put_end, msg.keys, msg.put_ids, msg.written))

    def lookup(msg: Lookup, payload, conn) -> LookupReply:
        release = service.owned_leases(msg.release, conn.scope) if conn.scope and msg.release else msg.release
        lease_id, entries = service.lookup(msg.keys, lease=msg.lease, release=release)
        return LookupReply(lease_id, entries)

    def release(msg: Release, payload, conn) -> None:
        service.release(service.owned_leases(msg.lease_ids, conn.scope) if conn.scope else msg.lease_ids)

    def register(msg: RegisterNode, payload, conn) -> Ok:
        service.register_node(msg.info, msg.objects, msg.mark)
        return Ok()

    def heartbeat(msg: Heartbeat, payload, conn) -> HeartbeatReply:
        known, mark = service.heartbeat(msg.node_id, msg.stats, msg.dropped, msg.moved)
        return HeartbeatReply(known, mark)

    def admin(msg: Admin, payload, conn) -> Info:
        if msg.method not in _ADMIN_METHODS:
            raise InvalidArgument(f"unknown admin method {msg.method!r}; known: {sorted(_ADMIN_METHODS)}")
        try:
            result = (_tenant_admin(msg, conn.scope) if conn.scope
                      else getattr(service.admin, msg.method)(**msg.args))
        except TypeError as exc:  # arguments the method does not take
            raise InvalidArgument(f"admin {msg.method}: {exc}") from None
        return Info({"result": result})

    def _tenant_admin(msg: Admin, scope: str):
        if msg.method not in _TENANT_METHODS:
            raise Forbidden(f"admin {msg.method} shows the whole pool; a tenant may call only "
                            f"{sorted(_TENANT_METHODS)}")
        args = dict(msg.args)
        if msg.method == "keys":
            prefix = args.pop("prefix", "")
            if not isinstance(prefix, str) or "\x00" in prefix:
                raise InvalidArgument("keys: prefix must be a string without NUL")
            return [unscope(k, scope) for k in service.admin.keys(scope + prefix, **args)]
        doc = service.admin.key_info(scope + check_key(args.pop("key", None)), **args)
        doc["key"] = unscope(doc["key"], scope)
        return doc

    return {
        Hello: hello,
        PutStart: put_start,
        PutEnd: put_end,
        Lookup: lookup,
        Release: release,
        Exists: lambda msg, p, c: Bools(service.exists(msg.keys)),
        MatchPrefix: lambda msg, p, c: Count(service.match_prefix(msg.keys)),
        Remove: lambda msg, p, c: Bools(service.remove(msg.keys)),
        RegisterNode: register,
        Heartbeat: heartbeat,
        Admin: admin,
    }
