"""The master's RPC face: wire messages -> `MasterService` calls -> wire replies.

Batch requests answer per item (`Err` in place of a result), so one bad key never fails the
others. `Admin` exposes the read-only admin methods by name (a fixed allow-list) for SDK users and tests.
"""

from __future__ import annotations

import socket
from typing import Any

from kvpool.errors import InvalidArgument
from kvpool.messages import (PROTOCOL_VERSION, Admin, BatchResult, Bools, Count, Exists, Heartbeat,
                             HeartbeatReply, Hello, HelloReply, Info, Lookup, LookupReply, MatchPrefix, Ok, PutEnd,
                             PutPlans, PutStart, RegisterNode, Release, Remove, per_item)

# Read-only on purpose: the RPC port has no token; changes go through the REST admin API.
_ADMIN_METHODS = {"nodes", "node", "stats", "key_info", "keys", "config"}


def master_handlers(service: Any, node: Any = None) -> dict[type, Any]:
    """Handlers for `service` (a `MasterService`); `node`: the embedded node, if any."""

    def hello(msg: Hello, payload, conn) -> HelloReply:
        return HelloReply(version=PROTOCOL_VERSION, roles=["master", "node"] if node is not None else ["master"],
                          leader=service.leader, node=node.info() if node is not None else None,
                          max_object_bytes=service.max_object_bytes(), replicas=service.replicas,
                          hostname=socket.gethostname(), unix=service.unix_address)

    def put_start(msg: PutStart, payload, conn) -> PutPlans:
        return PutPlans(per_item(lambda key, size: service.put_start(key, size, msg.replicas or None, msg.writer_node),
                                 msg.keys, msg.sizes))

    def put_end(msg: PutEnd, payload, conn) -> BatchResult:
        return BatchResult(per_item(service.put_end, msg.keys, msg.put_ids, msg.written))

    def lookup(msg: Lookup, payload, conn) -> LookupReply:
        lease_id, entries = service.lookup(msg.keys, lease=msg.lease, release=msg.release)
        return LookupReply(lease_id, entries)

    def release(msg: Release, payload, conn) -> None:
        service.release(msg.lease_ids)

    def register(msg: RegisterNode, payload, conn) -> Ok:
        service.register_node(msg.info, msg.objects)
        return Ok()

    def heartbeat(msg: Heartbeat, payload, conn) -> HeartbeatReply:
        return HeartbeatReply(service.heartbeat(msg.node_id, msg.stats, msg.dropped, msg.moved))

    def admin(msg: Admin, payload, conn) -> Info:
        if msg.method not in _ADMIN_METHODS:
            raise InvalidArgument(f"unknown admin method {msg.method!r}; known: {sorted(_ADMIN_METHODS)}")
        try:
            result = getattr(service.admin, msg.method)(**msg.args)
        except TypeError as exc:
            raise InvalidArgument(f"admin {msg.method}: {exc}") from None
        return Info({"result": result})

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
