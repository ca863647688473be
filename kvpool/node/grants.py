"""Data-plane grants of one node: how its transfer engine is locked down when a keyring is
configured, and who signs the ranges it hands out.

With a keyring, the node's transfer engine authenticates every data connection against it
(any principal of the keyring: a tenant's client reads through it too), proves the node
principal when it connects out, and serves only granted ranges (`transfer.grant`, signed with
`kvpool.security.keyring.grant_key` of the node principal's secret). The node signs a READ grant for each
range it pins for a reader (`Pins.grants`, until the pin's lease ends, revoked when the pin is
released) and a WRITE grant for each reservation (`Writes.open`, until the put's deadline,
revoked at its commit or abort). A revocation returns once no frame started under the grant
still moves bytes (`transfer.grant`: it waits for them, then cuts them), and the node frees or
publishes the range only after it: a range is never reused while such a frame runs. The RPC
that hands the ranges out is
itself authorized per principal (`kvpool.security.authz`): a tenant only ever pins or reserves its
own keys, so it only ever holds grants to its own objects' bytes.

With the user's own keyring (`kvpool.security.local`, the default without configuration) the
data port authenticates every connection but takes no grants: everyone who can prove that keyring
is its owner. Without any keyring (`KVPOOL_LOCAL_AUTH=off`) nothing changes: no handshake, no
grants, the data port serves any range (and the pool listens on loopback only).
"""

from __future__ import annotations

import logging
from typing import Any

from kvpool.security.keyring import Keyring, grant_key

log = logging.getLogger("kvpool.node")


def engine_access(keyring: Keyring | None) -> dict[str, Any]:
    """`TransferEngine` keyword arguments for a node's engine: auth, credential, grant key."""
    if keyring is None:
        return {}
    node = keyring.node_credential()
    if keyring.local:  # the user's own keyring: whoever proves it is the owner; grants would add nothing
        return {"auth": keyring.secret, "credential": (node.principal, node.secret)}
    return {"auth": keyring.secret, "credential": (node.principal, node.secret), "grant_key": grant_key(node.secret)}


def attach(engine: Any, segment: str, pins: Any, writes: Any, keyring: Keyring | None, node_id: str) -> None:
    """Have `pins` and `writes` sign grants of `segment` when `engine` requires them."""
    if not getattr(engine, "requires_grants", False):
        if keyring is not None and not keyring.local:
            log.warning("node %s: authentication is on but the transfer engine passed in takes no grants: its data "
                        "port serves any range of the arena to whoever reaches it", node_id)
        return

    pins.sign = writes.sign = engine.signer(segment)
    pins.revoke = writes.revoke = engine.revoke
