"""Who may send what on the pool RPC, and how a tenant's keys are scoped.

One table (`RULES`): message type -> (the least role that may send it, how its keys are scoped
for a tenant). A message type missing from the table is node-only, so a new message cannot be
forgotten into being open. Roles rank tenant < admin < node (`kvpool.security.keyring`); without a keyring
every connection is `ANYONE` (role node) and nothing here costs more than one identity check.

Tenants: the server rewrites every key a `tenant:<id>` principal names into "<id>\\x00<key>"
(`kvpool.contract.scope_prefix`) before any handler sees it. A user key never contains NUL
(`check_key`), so a tenant can only ever name its own keys: another tenant's key is simply a
different key, and every answer about it (get, exists, match_prefix, remove) is the plain miss
of the same code path, with no oracle. An admin or node principal names keys as stored.
"""

from __future__ import annotations

from typing import Any, Callable

from kvpool import messages as m
from kvpool.security.keyring import Principal
from kvpool.contract import MAX_KEY_BYTES, check_key, scope_prefix

TENANT, ADMIN, NODE = 0, 1, 2
ROLE_NAMES = {TENANT: "a tenant", ADMIN: "an admin", NODE: "a node"}

Scoper = Callable[[Any, str], None]


def rank(principal: Principal) -> int:
    return NODE if principal.role == "node" else ADMIN if principal.role == "admin" else TENANT


def _keys(msg: Any, prefix: str) -> None:
    """Scope `msg.keys` in place: the message is this request's own, decoded from the wire."""
    keys = msg.keys
    if len(keys) == 1:  # a single-key request, the common case: no comprehension (a call of its own), no new list
        key = keys[0]
        # `check_key`'s fast path inline (a call costs ~600 instructions, a fifth of this function)
        if type(key) is not str or not key.isascii() or not 0 < len(key) <= MAX_KEY_BYTES or "\x00" in key:
            check_key(key)
        keys[0] = prefix + key
    else:
        msg.keys = [prefix + check_key(k) for k in keys]


def _touched(msg: Any, prefix: str) -> None:
    msg.touched = [prefix + check_key(k) for k in msg.touched]


# message type -> (least role, scoper for a tenant's keys or None when it names no key)
RULES: dict[type, tuple[int, Scoper | None]] = {
    m.Hello: (TENANT, None),
    m.PutStart: (TENANT, _keys),
    m.PutEnd: (TENANT, _keys),
    m.Lookup: (TENANT, _keys),
    m.Release: (TENANT, None),
    m.Exists: (TENANT, _keys),
    m.MatchPrefix: (TENANT, _keys),
    m.Remove: (TENANT, _keys),
    m.Admin: (TENANT, None),  # per method: `kvpool.master.handlers` (a tenant lists only its own keys)
    m.NodeGet: (TENANT, _keys),
    m.NodePin: (TENANT, _keys),
    m.NodeUnpin: (TENANT, _touched),
    m.NodeWrite: (TENANT, _keys),
    m.NodeReserve: (TENANT, _keys),
    m.NodeCommit: (TENANT, _keys),
    m.Put: (TENANT, _keys),  # PutStart + NodeWrite + PutEnd to an embedded pool
    m.PutReserve: (TENANT, _keys),  # PutStart + NodeReserve, likewise
    m.PutCommit: (TENANT, _keys),  # NodeCommit + PutEnd, likewise
    m.NodeStats: (TENANT, None),
    # Node-only, listed for the reader (unlisted types are node-only anyway): membership and the
    # master's housekeeping (removals naming a put, drain copies between nodes).
    m.RegisterNode: (NODE, None),
    m.Heartbeat: (NODE, None),
    m.NodeRemove: (NODE, None),
    m.NodeCopy: (NODE, None),
}
NODE_ONLY: tuple[int, Scoper | None] = (NODE, None)  # the rule of a type missing from RULES


def scope_of(principal: Principal) -> str:
    """The prefix of `principal`'s stored keys ("" when it names keys as stored)."""
    return scope_prefix(principal.tenant) if principal.role == "tenant" else ""


def unscope(key: str, prefix: str) -> str:
    return key[len(prefix):] if prefix and key.startswith(prefix) else key
