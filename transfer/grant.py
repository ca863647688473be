"""Data-plane capabilities: a grant lets its holder READ or WRITE one byte range of one segment
of one engine until it expires; its holder is the principal it names, and only a connection
authenticated as that principal may use it.

Whoever owns the segment's contents (the pool's node: it knows which arena range holds which
object, and for whom it pinned or reserved it) signs a grant with a key only it and its peers
hold; the client sends it with each READ/WRITE of that range (`wire.FLAG_GRANT`); an engine
built with `grant_key` serves only requests a valid grant covers. `transfer` does not know who
may have what: it only checks the signature, the op, the range and the time.

Wire (48 bytes, little-endian, after the request header):

    op u8 | serial u16 | 0 u8 | seg_id u32 | offset u64 | length u64 | expires u64 (unix ms) | mac (16)

    mac = BLAKE2b-128 keyed with `key` of
          ("kvpool-grant/v2" | 0 | engine name | 0 | len(principal) u8 | principal | the 32 bytes before it)

(Keyed BLAKE2b is a MAC; it costs a third of HMAC-SHA256 here, and every request checks one.)

The engine's name is in the MAC but not on the wire, so a grant for one engine's segment #1 is
not one for another engine's segment #1 (the pool's nodes share one grant key). So is the
holder's principal (the name its data connection proved, `transfer.auth`; "" on a server without
authentication): the data server checks a grant against the principal of the connection that
presents it, so a grant is no bearer token: one another principal learned (a log, a shared
buffer, a replay) is worth nothing on its own connection. Expiry is wall
clock (`time.time()`): the signer and the checker are one process in the pool, and a grant
handed across hosts needs their clocks within the grant's lifetime of each other.

Revocation: the signer revokes a grant whose range stops being the holder's before the grant
expires (a pin released, a reservation committed or aborted), so the range can be reused for
another object without the old holder reaching it. A grant is checked when a frame starts, and
a frame can take long (a WRITE whose sender pauses, a READ whose receiver drains slowly), so
the checker also counts the frames moving bytes under each grant (`admit` ... `done`), and
`revoke` returns only once none is left: it gives them `GRACE` seconds to finish (a well-behaved
frame is done by then: its holder asks for the revocation only after its bytes moved), then
cuts the rest (their connections are shut down and the server stops touching the range within
one `CUT_STEP`) and waits for them to stop. So when `revoke` returns, no byte of the range moves
under that grant any more, and its owner may reuse the range.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import logging
import socket
import struct
import threading
import time
from typing import Callable

from transfer.framing import shutdown

READ, WRITE = 1, 2  # as transfer.batch
GRANT = struct.Struct("<BHxIQQQ16s")  # op, serial, seg_id, offset, length, expires ms, mac
SIZE = GRANT.size  # 48
SIGNED = SIZE - 16
_SIGNED = struct.Struct("<BHxIQQQ")
_LABEL = b"kvpool-grant/v2\0"
_OPS = {READ: "READ", WRITE: "WRITE"}
SWEEP_AT = 4096  # revoked entries before the expired ones are swept (then twice what is left)
GRACE = 0.1  # seconds a revoked grant's frames get to finish by themselves before they are cut
CUT_STEP = 1 << 20  # a WRITE under a grant is received in steps of this, each after a look at `Frame.cut`
STUCK_LOG_S = 5.0  # a revoke still waiting for a cut frame logs again after this

log = logging.getLogger("transfer.grant")


class Frame:
    """One connection's frame in flight under a grant (`Grants.admit` .. `Grants.done`):
    `cut` is set (and `sock` shut down) when its grant is revoked while it still moves bytes."""

    __slots__ = ("sock", "principal", "signed", "cut")

    def __init__(self, sock: socket.socket | None, principal: str = ""):
        self.sock = sock
        self.principal = principal  # who the connection proved: the grants it presents must name it
        self.signed: bytes | None = None
        self.cut = False


class Grants:
    """Signs, checks and revokes the grants of one engine's segments (`engine`: its name, `key`:
    the shared grant key, at least 16 bytes). Thread-safe: the node's threads sign and revoke
    while the data server's threads check."""

    def __init__(self, key: bytes, engine: str):
        if len(key) < 16:
            raise ValueError("a grant key must be at least 16 bytes")
        self._key = bytes(key)
        self._prefix = _LABEL + engine.encode() + b"\0"
        self._keyed = hashlib.blake2b(self._prefix, key=self._key, digest_size=16)  # copied per MAC: no keyed init
        self._serial = itertools.count(1)
        self._revoked: dict[bytes, int] = {}  # signed part of a revoked grant -> its expiry (ms)
        self._sweep_at = SWEEP_AT
        self._last: tuple = (b"", "", None)  # the last grant whose signature checked: its holder, its fields
        self._moving: dict[Frame, None] = {}  # frames moving bytes under a grant now (`Frame.signed`: which)
        self._lock = threading.Lock()  # revokes (the hot path, `admit` / `done`, takes none)
        self._ended = threading.Condition(self._lock)  # notified when a frame ends while a revoke waits
        self._awaited = 0  # revokes waiting for frames to end

    def _mac(self, principal: str, signed: bytes) -> bytes:
        name = principal.encode()
        if len(name) > 255:
            raise ValueError("a principal name is at most 255 bytes of UTF-8")
        h = self._keyed.copy()
        h.update(bytes((len(name),)) + name + signed)
        return h.digest()

    def signer(self, seg_id: int) -> Callable[[int, int, int, float, str], bytes]:
        """`sign` for one segment: (op, offset, length, ttl_s, principal) -> grant (the node's hot path)."""
        serial, pack, mac, now = self._serial, _SIGNED.pack, self._mac, time.time

        def sign(op: int, offset: int, length: int, ttl_s: float, principal: str = "") -> bytes:
            signed = pack(op, next(serial) & 0xFFFF, seg_id, offset, length, int((now() + ttl_s) * 1000))
            return signed + mac(principal, signed)

        return sign

    def sign(self, op: int, seg_id: int, offset: int, length: int, ttl_s: float, principal: str = "") -> bytes:
        """A grant for `op` on [offset, offset + length) of segment `seg_id`, valid `ttl_s` seconds,
        to `principal` (the name its data connection proves; "": a server without authentication).
        Each grant is distinct (a serial), so revoking one never revokes a later one of the range."""
        if op not in _OPS:
            raise ValueError(f"grant op must be READ or WRITE, got {op!r}")
        return self.signer(seg_id)(op, offset, length, ttl_s, principal)

    def revoke(self, grant: bytes) -> None:
        """Refuse `grant` from now on, before it expires (the pin it came with was released, the
        reservation ended): its range may soon hold another object. Returns once no frame moves
        bytes under it any more (see the module doc): it may block for `GRACE` seconds and a cut."""
        if len(grant) != SIZE:
            return
        signed = bytes(grant[:SIGNED])
        now = time.time() * 1000
        with self._lock:
            revoked = self._revoked
            if len(revoked) >= self._sweep_at:  # amortized: a sweep per doubling, not per revoke
                # (a minute late: a frame whose grant checked just before it expired may still be admitted)
                revoked = self._revoked = {k: t for k, t in list(revoked.items()) if t > now - 60_000}
                self._sweep_at = max(SWEEP_AT, 2 * len(revoked))
            expires = _SIGNED.unpack(signed)[5]
            revoked[signed] = max(expires, int(now) + 1)  # kept until the sweep even if expired: `admit` reads it
            # After the mark: a frame admitted from now on is refused, and one admitted before is in `_moving`.
            # (`_moving` tested first: it is empty unless a frame is in flight, and the scan costs
            # ~1,500 instructions per revoke, a pin's release, ~0.4% of an 8 MiB get's)
            if self._moving and self._under(signed):
                self._awaited += 1
                try:
                    self._stop_frames(signed)
                finally:
                    self._awaited -= 1

    def _under(self, signed: bytes) -> list[Frame]:
        return [f for f in list(self._moving) if f.signed == signed]

    def _stop_frames(self, signed: bytes) -> None:
        """Wait for the frames of the (just revoked) grant `signed` to end, cutting those that do
        not end within `GRACE` seconds (lock held; the waits release it)."""
        deadline = time.monotonic() + GRACE
        while (left := deadline - time.monotonic()) > 0 and self._under(signed):
            self._ended.wait(left)
        frames = self._under(signed)
        if not frames:
            return
        op, _, seg_id, offset, length, _ = _SIGNED.unpack(signed)
        log.info("grant revoked while %d frame(s) still moved bytes under it (%s of [%d, +%d) on #%d): "
                 "cutting their connections", len(frames), _OPS.get(op, op), offset, length, seg_id)
        for frame in frames:
            frame.cut = True
            if frame.sock is not None:
                shutdown(frame.sock)  # wakes its thread out of recv / send
        while frames := self._under(signed):
            if not self._ended.wait(STUCK_LOG_S):
                log.warning("still waiting for %d cut frame(s) of a revoked grant to stop", len(frames))

    def check(self, grant: bytes | bytearray | memoryview, op: int, seg_id: int, offset: int,
              length: int, principal: str = "") -> str | None:
        """Why `grant` does not allow `principal` `op` on [offset, offset + length) of `seg_id`
        (None: it does)."""
        why, signed = self._verify(grant, op, seg_id, offset, length, principal)
        if why is None and self._revoked and signed in self._revoked:
            return REVOKED
        return why

    def admit(self, grant: bytes | bytearray | memoryview, op: int, seg_id: int, offset: int, length: int,
              frame: Frame) -> str | None:
        """`check`, and when the grant allows the op, count `frame` as moving bytes under it until
        `done(frame)` (a revocation meanwhile waits for it, or cuts it).

        No lock (this runs per frame): each step is one atomic operation under the GIL, in an
        order that makes it safe against `revoke`, which marks the grant first and then looks
        for its frames: the frame is entered before the mark is read, so either the revoke
        finds the frame or the frame finds the mark."""
        why, signed = self._verify(grant, op, seg_id, offset, length, frame.principal)
        if why is not None:
            return why
        frame.signed = signed
        self._moving[frame] = None
        if self._revoked and signed in self._revoked:
            self.done(frame)
            return REVOKED
        return None

    def done(self, frame: Frame) -> None:
        """`frame`, admitted by `admit`, moves no more bytes."""
        self._moving.pop(frame, None)
        frame.signed = None
        if self._awaited:  # a revoke is waiting for its frames to end
            with self._lock:
                self._ended.notify_all()

    def _verify(self, grant: bytes | bytearray | memoryview, op: int, seg_id: int, offset: int,
                length: int, principal: str) -> tuple[str | None, bytes]:
        """(why `grant` does not allow the op, revocation aside (None: it does), its signed part).
        The slices of one op carry the same grant: its signature is checked once."""
        if len(grant) != SIZE:
            return "malformed grant", b""
        last, holder, known = self._last
        if grant == last and principal == holder:
            g_op, g_seg, g_off, g_len, expires, signed = known
        else:
            g_op, _, g_seg, g_off, g_len, expires, mac = GRANT.unpack(grant)
            signed = bytes(grant[:SIGNED])
            if not hmac.compare_digest(mac, self._mac(principal, signed)):
                return (f"grant signature is not valid for principal {principal!r} (issued to another principal, "
                        "forged, altered, or for another engine)"), signed
            self._last = (bytes(grant), principal, (g_op, g_seg, g_off, g_len, expires, signed))
        if g_op != op:
            return f"a {_OPS.get(g_op, g_op)} grant does not allow a {_OPS.get(op, op)}", signed
        if g_seg != seg_id:
            return f"grant is for segment #{g_seg}, not #{seg_id}", signed
        if offset < g_off or offset + length > g_off + g_len:
            return f"[{offset}, {offset + length}) is outside the granted [{g_off}, {g_off + g_len})", signed
        if expires <= time.time() * 1000:
            return "grant expired", signed
        return None, signed


REVOKED = "grant revoked (its pin was released or its reservation ended)"


def fields(grant: bytes | bytearray | memoryview) -> tuple:
    """(op, seg_id, offset, length, expires ms) of a grant, unchecked (for logs and tests)."""
    op, _, seg_id, offset, length, expires, _ = GRANT.unpack(grant)
    return op, seg_id, offset, length, expires
