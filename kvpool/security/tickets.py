"""Put tickets: the master's signed word that a node may take one write.

In cluster mode a client writes a put's bytes straight to the nodes the master planned, and a
node cannot ask the master about every write (a round trip per put). So the master signs, with
each target of a plan, a ticket naming the write it admitted, and the node checks it on its own:

    ticket = version u8 (1) | deadline u64 (unix ms) | mac (16)
    mac    = BLAKE2b-128 keyed with `ticket_key` of
             ("kvpool-ticket/v1" | 0 | put id u64 | size u64 | deadline u64 | tenant | node id | key),
             each string as u16 length + UTF-8

The put id, size, tenant, node and key are not on the wire: the node has them from the write
itself (the key as stored, scoped to the writer's tenant by `kvpool.security.authz`), so a
ticket admits exactly that write of that key, that size, on that node, under that put, until
the deadline. The master admitted the put under the tenant's pool-wide quota before signing, so
a node that takes only ticketed writes never holds bytes outside the master's account: a
`NodeWrite` or `NodeReserve` with an invented put id, another node's ticket, another key's or
size's, or one past its deadline is refused (`Forbidden`) before a byte is reserved. A node also
refuses a second write under one ticket (`Spent`), so a ticket cannot be replayed after its
object was removed (a client retrying a put starts it again at the master: a new put id).

The key is the node principal's secret (`kvpool.security.keyring.ticket_key`), which masters and
nodes share through the keyring; tenants cannot make one. The deadline is wall clock: masters'
and nodes' clocks must agree within `SKEW_MS` plus the put timeout. Without a keyring there are
no tickets and nodes take any write of a pending put, as before (loopback only); nor with the
user's own keyring (`kvpool.security.local`), whose one principal, `node`, could sign them itself.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import threading
import time

from kvpool.security.tenancy import tenant_of

VERSION = 1
TICKET = struct.Struct("<BQ16s")
SIZE = TICKET.size  # 25
_FIELDS = struct.Struct("<QQQ")
_LABEL = b"kvpool-ticket/v1\0"
SKEW_MS = 5_000  # how far a node's clock may run ahead of its master's


def _text(value: str) -> bytes:
    raw = value.encode()
    return len(raw).to_bytes(2, "little") + raw


class Tickets:
    """Signs (the master) and checks (a node) put tickets under `key` (`ticket_key`, 32 bytes)."""

    def __init__(self, key: bytes):
        if len(key) < 16:
            raise ValueError("a ticket key must be at least 16 bytes")
        self._keyed = hashlib.blake2b(_LABEL, key=bytes(key), digest_size=16)  # copied per MAC: no keyed init

    def _mac(self, put_id: int, key: str, size: int, node_id: str, deadline_ms: int) -> bytes:
        h = self._keyed.copy()
        h.update(b"".join((_FIELDS.pack(put_id, size, deadline_ms), _text(tenant_of(key)), _text(node_id), _text(key))))
        return h.digest()

    def sign(self, put_id: int, key: str, size: int, node_id: str, ttl_s: float) -> bytes:
        """A ticket for the write of `size` bytes of `key` (as stored) under put `put_id` on
        node `node_id`, valid `ttl_s` seconds (the put's timeout)."""
        deadline = int((time.time() + ttl_s) * 1000)
        return TICKET.pack(VERSION, deadline, self._mac(put_id, key, size, node_id, deadline))

    def check(self, ticket: bytes, put_id: int, key: str, size: int, node_id: str) -> str | None:
        """Why `ticket` does not admit this write (None: it does)."""
        if not ticket:
            return "no put ticket (a write must be planned by the master: start the put there)"
        if len(ticket) != SIZE:
            return "malformed put ticket"
        version, deadline, mac = TICKET.unpack(ticket)
        if version != VERSION:
            return f"put ticket version {version} is not supported (this node reads {VERSION})"
        if not hmac.compare_digest(mac, self._mac(put_id, key, size, node_id, deadline)):
            return ("put ticket does not admit this write (issued for another put, key, size or node, or "
                    "not by a master)")
        if deadline + SKEW_MS <= time.time() * 1000:
            return "put ticket expired (the put's deadline passed)"
        return None


class Spent:
    """Tickets (put id, key) a write on this node already used, kept until their deadline passes
    (the ticket is refused as expired after that anyway). Thread-safe."""

    def __init__(self) -> None:
        self._used: dict[tuple[int, str], float] = {}  # -> wall-clock deadline (s), skew included
        self._lock = threading.Lock()

    def take(self, put_id: int, key: str, ticket: bytes) -> bool:
        """Use the (valid) ticket of put `put_id` of `key`: False when it was used before."""
        until = TICKET.unpack(ticket)[1] / 1000 + SKEW_MS / 1000
        with self._lock:
            if (put_id, key) in self._used:
                return False
            self._used[(put_id, key)] = until
            return True

    def sweep(self) -> None:
        now = time.time()
        with self._lock:
            if self._used:
                self._used = {k: t for k, t in self._used.items() if t > now}
