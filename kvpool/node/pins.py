"""Pins of one store node: a pinned object is never evicted or freed (`TieredStore.pin`), so a
reader copying out of the arena (same-host through its mapping, a transfer-engine READ, or the
node sending a `NodeGet` reply) never sees another object's bytes.

Invariant: a pin handed to a reader (`hold`) is released exactly once, by the reader (`release`),
the close of its connection (`conn_closed`) or the end of its lease (`expire`): whoever pops the
pin id under the lock unpins its keys.

Grants: when the node's transfer engine requires them (authentication on), each pinned range
handed to a reader comes with a READ grant (`grants`) to that reader's principal that expires with the pin's lease and is
revoked when the pin is released (whoever releases it), before the unpin, so the data server
serves that reader exactly the pinned bytes, and only while they are pinned: the revocation
returns only once no READ frame started under the grant is still sending (it waits for them
briefly, then cuts them: `transfer.grant`), because once unpinned (and removed or evicted), the
range may hold another tenant's object.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from kvpool.errors import CapacityError, KVPoolError
from kvpool.messages import NodeData
from transfer import READ

log = logging.getLogger("kvpool.node")


class Pins:
    """`store`: the node's `TieredStore`; `visible(key)`: the in-process master's say on a key
    (embedded mode: it counts the access), or None; `lease_s`: how long a held pin lives."""

    def __init__(self, store: Any, lease_s: float, visible: Callable[[str], bool] | None = None):
        self.store = store
        self.lease_s = lease_s
        # (op, offset, length, ttl_s, principal) -> a grant of our transfer segment, or None: no grants
        self.sign: Callable[[int, int, int, float, str], bytes | None] | None = None
        self.revoke: Callable[[bytes], None] | None = None
        self._grants: dict[int, list[bytes]] = {}  # pin id -> the grants handed out with it
        self._visible = visible
        self._held: dict[int, tuple[list[str], float]] = {}  # pin id -> (keys, until)
        self._seq = 0
        self._lock = threading.Lock()

    def pin(self, keys: list[str]) -> tuple[list[str], list[int], list[int], dict[int, bytes], list[int]]:
        """Pin each key in DRAM: (pinned keys, offsets, sizes (-1: miss), copies, ssd).

        A batch larger than free DRAM cannot have all its SSD objects promoted and pinned at
        once; those (CapacityError) are read straight from SSD into `copies[i]` instead of
        being reported as misses. `ssd`: the positions served from the SSD tier (promoted, or
        copied), so a reader can tell which tier its hits came from."""
        pinned, offsets, sizes, ssd = [], [], [], []
        copies: dict[int, bytes] = {}
        store, visible = self.store, self._visible
        for i, key in enumerate(keys):
            if visible is not None and not visible(key):
                offsets.append(0)
                sizes.append(-1)
                continue
            try:
                loc = store.pin(key)
            except CapacityError:  # DRAM all pinned: serve this one from SSD without promoting
                data = store.get(key)
                offsets.append(-1)
                sizes.append(-1 if data is None else len(data))
                if data is not None:
                    copies[i] = data
                    ssd.append(i)
                continue
            except (KVPoolError, ValueError):  # absent, being removed: a miss
                offsets.append(0)
                sizes.append(-1)
                continue
            pinned.append(key)
            offsets.append(loc.offset)
            sizes.append(loc.length)
            if loc.from_ssd:
                ssd.append(i)
        return pinned, offsets, sizes, copies, ssd

    def get_one(self, key: str, arena: memoryview) -> tuple:
        """`pin([key])` as a `NodeGet` reply: (NodeData, the object's bytes, the unpin to run once
        they are sent), for the single get that most requests are."""
        visible = self._visible
        if visible is not None and not visible(key):
            return NodeData([-1], []), ()
        store = self.store
        try:
            loc = store.pin(key)
        except CapacityError:  # DRAM all pinned: served from SSD without promoting
            data = store.get(key)
            if data is None:
                return NodeData([-1], []), ()
            return NodeData([len(data)], [0]), (memoryview(data),)
        except (KVPoolError, ValueError):  # absent, being removed: a miss
            return NodeData([-1], []), ()
        offset, length = loc.offset, loc.length
        return (NodeData([length], [0] if loc.from_ssd else []), (arena[offset:offset + length],),
                lambda: self.unpin((key,)))

    def grants(self, offsets: list[int], sizes: list[int], pin_id: int, principal: str) -> list[bytes]:
        """A READ grant per range pinned under `pin_id` (b"" for misses and inline objects) to
        `principal` (the reader: only its own data connections may use them), valid for the pin's
        lease and revoked with the pin; [] when the engine takes no grants."""
        sign = self.sign
        if sign is None or not pin_id:
            return []
        lease = self.lease_s
        out = [sign(READ, o, n, lease, principal) if n >= 0 and o >= 0 else b"" for o, n in zip(offsets, sizes)]
        with self._lock:
            if pin_id in self._held:
                self._grants[pin_id] = [g for g in out if g]
                return out
        return []  # released meanwhile (its connection closed): nothing to hand out

    def granted(self, pin_ids: list[int]) -> bool:
        """Whether any of these pins came with grants (releasing it revokes them, which may wait
        for a READ in flight)."""
        grants = self._grants
        return bool(grants) and any(pid in grants for pid in pin_ids)

    def unpin(self, keys: list[str]) -> None:
        store = self.store
        if store is None:  # stopped: the pins went with the store
            return
        for key in keys:
            try:
                store.unpin(key)
            except KVPoolError:
                log.debug("unpin of %r: not pinned", key)

    def hold(self, keys: list[str], conn: Any) -> int:
        """Keep `keys` (pinned) for the reader on `conn` until it releases the returned pin id."""
        with self._lock:
            self._seq += 1
            pin_id = self._seq
            self._held[pin_id] = (keys, time.monotonic() + self.lease_s)
        if conn is not None:
            conn.state.setdefault("pins", set()).add(pin_id)
        return pin_id

    def release(self, pin_ids: list[int], conn: Any = None) -> None:
        """Release pins; a connection (`conn`) releases only its own (pin ids are guessable)."""
        if conn is not None:
            mine = conn.state.get("pins", ())
            pin_ids = [pid for pid in pin_ids if pid in mine]
        for pid in pin_ids:
            with self._lock:
                entry = self._held.pop(pid, None)
                granted = self._grants.pop(pid, ())
            if granted and self.revoke is not None:
                for grant in granted:  # before the unpin: the range may be reused right after
                    self.revoke(grant)
            if entry is not None:
                self.unpin(entry[0])
            if conn is not None:
                conn.state.get("pins", set()).discard(pid)

    def expire(self) -> int:
        """Release pins held past their lease; how many."""
        now = time.monotonic()
        with self._lock:
            stale = [pid for pid, (_, until) in self._held.items() if until <= now]
        self.release(stale)
        return len(stale)

    def conn_closed(self, conn: Any) -> None:
        self.release(list(conn.state.get("pins", ())))

    def close(self) -> None:
        self.store = None
