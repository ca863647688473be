"""Data-plane capabilities: a grant lets its holder READ or WRITE one byte range of one segment
of one engine until it expires.

Whoever owns the segment's contents (the pool's node: it knows which arena range holds which
object, and for whom it pinned or reserved it) signs a grant with a key only it and its peers
hold; the client sends it with each READ/WRITE of that range (`wire.FLAG_GRANT`); an engine
built with `grant_key` serves only requests a valid grant covers. `transfer` does not know who
may have what: it only checks the signature, the op, the range and the time.

Wire (48 bytes, little-endian, after the request header):

    op u8 | serial u16 | 0 u8 | seg_id u32 | offset u64 | length u64 | expires u64 (unix ms) | mac (16)

    mac = BLAKE2b-128 keyed with `key` of ("kvpool-grant/v1" | 0 | engine name | 0 | the 32 bytes before it)

(Keyed BLAKE2b is a MAC; it costs a third of HMAC-SHA256 here, and every request checks one.)

The engine's name is in the MAC but not on the wire, so a grant for one engine's segment #1 is
not one for another engine's segment #1 (the pool's nodes share one grant key). Expiry is wall
clock (`time.time()`): the signer and the checker are one process in the pool, and a grant
handed across hosts needs their clocks within the grant's lifetime of each other.

Revocation: the signer revokes a grant whose range stops being the holder's before the grant
expires (a pin released, a reservation committed or aborted), so the range can be reused for
another object without the old holder reaching it. A WRITE frame already being received when
its grant is revoked still lands (bounded by the minimum body rate): the pool's reservation
invariant keeps such a range out of reuse only until the put's deadline (`kvpool.node.writes`).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import struct
import time
from typing import Callable

READ, WRITE = 1, 2  # as transfer.batch
GRANT = struct.Struct("<BHxIQQQ16s")  # op, serial, seg_id, offset, length, expires ms, mac
SIZE = GRANT.size  # 48
SIGNED = SIZE - 16
_SIGNED = struct.Struct("<BHxIQQQ")
_EXPIRES, _EXPIRES_AT = struct.Struct("<Q"), SIGNED - 8
_LABEL = b"kvpool-grant/v1\0"
_OPS = {READ: "READ", WRITE: "WRITE"}
SWEEP_AT = 4096  # revoked entries before the expired ones are swept (then twice what is left)


class Grants:
    """Signs, checks and revokes the grants of one engine's segments (`engine`: its name, `key`:
    the shared grant key, at least 16 bytes). Thread-safe: the node's threads sign and revoke
    while the data server's threads check."""

    def __init__(self, key: bytes, engine: str):
        if len(key) < 16:
            raise ValueError("a grant key must be at least 16 bytes")
        self._key = bytes(key)
        self._prefix = _LABEL + engine.encode() + b"\0"
        self._serial = itertools.count(1)
        self._revoked: dict[bytes, int] = {}  # signed part of a revoked grant -> its expiry (ms)
        self._sweep_at = SWEEP_AT
        self._last: tuple = (b"", None)  # the last grant whose signature checked, and its fields

    def _mac(self, signed: bytes) -> bytes:
        return hashlib.blake2b(self._prefix + signed, key=self._key, digest_size=16).digest()

    def signer(self, seg_id: int) -> Callable[[int, int, int, float], bytes]:
        """`sign` for one segment: (op, offset, length, ttl_s) -> grant (the node's hot path)."""
        serial, pack, mac, now = self._serial, _SIGNED.pack, self._mac, time.time

        def sign(op: int, offset: int, length: int, ttl_s: float) -> bytes:
            signed = pack(op, next(serial) & 0xFFFF, seg_id, offset, length, int((now() + ttl_s) * 1000))
            return signed + mac(signed)

        return sign

    def sign(self, op: int, seg_id: int, offset: int, length: int, ttl_s: float) -> bytes:
        """A grant for `op` on [offset, offset + length) of segment `seg_id`, valid `ttl_s` seconds.
        Each grant is distinct (a serial), so revoking one never revokes a later one of the range."""
        if op not in _OPS:
            raise ValueError(f"grant op must be READ or WRITE, got {op!r}")
        expires = int((time.time() + ttl_s) * 1000)
        signed = _SIGNED.pack(op, next(self._serial) & 0xFFFF, seg_id, offset, length, expires)
        return signed + self._mac(signed)

    def revoke(self, grant: bytes) -> None:
        """Refuse `grant` from now on, before it expires (the pin it came with was released, the
        reservation ended): its range may soon hold another object."""
        if len(grant) != SIZE:
            return
        now = time.time() * 1000
        revoked = self._revoked
        if len(revoked) >= self._sweep_at:  # amortized: a sweep per doubling, not per revoke
            revoked = self._revoked = {k: t for k, t in list(revoked.items()) if t > now}
            self._sweep_at = max(SWEEP_AT, 2 * len(revoked))
        expires = _EXPIRES.unpack_from(grant, _EXPIRES_AT)[0]
        if expires > now:
            revoked[bytes(grant[:SIGNED])] = expires

    def check(self, grant: bytes | bytearray | memoryview, op: int, seg_id: int, offset: int,
              length: int) -> str | None:
        """Why `grant` does not allow `op` on [offset, offset + length) of `seg_id` (None: it does).
        The slices of one op carry the same grant: its signature is checked once."""
        if len(grant) != SIZE:
            return "malformed grant"
        last, known = self._last
        if grant == last:
            g_op, g_seg, g_off, g_len, expires, signed = known
        else:
            g_op, _, g_seg, g_off, g_len, expires, mac = GRANT.unpack(grant)
            signed = bytes(grant[:SIGNED])
            if not hmac.compare_digest(mac, self._mac(signed)):
                return "grant signature is not valid (forged, altered, or for another engine)"
            self._last = (bytes(grant), (g_op, g_seg, g_off, g_len, expires, signed))
        if g_op != op:
            return f"a {_OPS.get(g_op, g_op)} grant does not allow a {_OPS.get(op, op)}"
        if g_seg != seg_id:
            return f"grant is for segment #{g_seg}, not #{seg_id}"
        if offset < g_off or offset + length > g_off + g_len:
            return f"[{offset}, {offset + length}) is outside the granted [{g_off}, {g_off + g_len})"
        if expires <= time.time() * 1000:
            return "grant expired"
        if self._revoked and signed in self._revoked:
            return "grant revoked (its pin was released or its reservation ended)"
        return None


def fields(grant: bytes | bytearray | memoryview) -> tuple:
    """(op, seg_id, offset, length, expires ms) of a grant, unchecked (for logs and tests)."""
    op, _, seg_id, offset, length, expires, _ = GRANT.unpack(grant)
    return op, seg_id, offset, length, expires
