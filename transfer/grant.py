"""Data-plane capabilities: a grant lets its holder READ or WRITE one byte range of one segment
of one engine until it expires.

Whoever owns the segment's contents (the pool's node: it knows which arena range holds which
object, and for whom it pinned or reserved it) signs a grant with a key only it and its peers
hold; the client sends it with each READ/WRITE of that range (`wire.FLAG_GRANT`); an engine
built with `grant_key` serves only requests a valid grant covers. `transfer` does not know who
may have what: it only checks the signature, the op, the range and the time.

Wire (48 bytes, little-endian, after the request header):

    op u8 | 0 (3) | seg_id u32 | offset u64 | length u64 | expires u64 (unix ms) | mac (16)

    mac = HMAC-SHA256(key, "kvpool-grant/v1" | 0 | engine name | 0 | the 32 bytes before it)[:16]

The engine's name is in the MAC but not on the wire, so a grant for one engine's segment #1 is
not one for another engine's segment #1 (the pool's nodes share one grant key). Expiry is wall
clock (`time.time()`): the signer and the checker are one process in the pool, and a grant
handed across hosts needs their clocks within the grant's lifetime of each other.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import time

READ, WRITE = 1, 2  # as transfer.batch
GRANT = struct.Struct("<BxxxIQQQ16s")
SIZE = GRANT.size  # 48
_SIGNED = struct.Struct("<BxxxIQQQ")
_LABEL = b"kvpool-grant/v1\0"
_OPS = {READ: "READ", WRITE: "WRITE"}


class Grants:
    """Signs and checks the grants of one engine's segments (`engine`: its name, `key`: the
    shared grant key, at least 16 bytes)."""

    def __init__(self, key: bytes, engine: str):
        if len(key) < 16:
            raise ValueError("a grant key must be at least 16 bytes")
        self._key = bytes(key)
        self._prefix = _LABEL + engine.encode() + b"\0"

    def _mac(self, signed: bytes) -> bytes:
        return hmac.digest(self._key, self._prefix + signed, "sha256")[:16]

    def sign(self, op: int, seg_id: int, offset: int, length: int, ttl_s: float) -> bytes:
        """A grant for `op` on [offset, offset + length) of segment `seg_id`, valid `ttl_s` seconds."""
        if op not in _OPS:
            raise ValueError(f"grant op must be READ or WRITE, got {op!r}")
        expires = int((time.time() + ttl_s) * 1000)
        signed = _SIGNED.pack(op, seg_id, offset, length, expires)
        return signed + self._mac(signed)

    def check(self, grant: bytes | bytearray | memoryview, op: int, seg_id: int, offset: int,
              length: int) -> str | None:
        """Why `grant` does not allow `op` on [offset, offset + length) of `seg_id` (None: it does)."""
        if len(grant) != SIZE:
            return "malformed grant"
        g_op, g_seg, g_off, g_len, expires, mac = GRANT.unpack(grant)
        if not hmac.compare_digest(mac, self._mac(bytes(grant[:SIZE - 16]))):
            return "grant signature is not valid (forged, altered, or for another engine)"
        return self.allows((g_op, g_seg, g_off, g_len, expires), op, seg_id, offset, length)

    @staticmethod
    def allows(fields: tuple, op: int, seg_id: int, offset: int, length: int) -> str | None:
        """The checks after the signature: op, segment, range, expiry."""
        g_op, g_seg, g_off, g_len, expires = fields
        if g_op != op:
            return f"a {_OPS.get(g_op, g_op)} grant does not allow a {_OPS.get(op, op)}"
        if g_seg != seg_id:
            return f"grant is for segment #{g_seg}, not #{seg_id}"
        if offset < g_off or offset + length > g_off + g_len:
            return f"[{offset}, {offset + length}) is outside the granted [{g_off}, {g_off + g_len})"
        if expires <= time.time() * 1000:
            return "grant expired"
        return None


def fields(grant: bytes | bytearray | memoryview) -> tuple:
    """(op, seg_id, offset, length, expires ms) of a grant, unchecked (for logs and tests)."""
    return GRANT.unpack(grant)[:5]
