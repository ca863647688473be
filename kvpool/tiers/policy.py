"""Eviction policies behind one Protocol: LRU, and two scan-resistant ones, S3-FIFO and ARC.

A policy only orders keys; the tier owner decides when to evict (when an allocation fails) and
what may go (`evictable`, false for pinned or half-written objects).

Invariants of every policy:
- it tracks exactly the keys inserted and not yet removed or evicted;
- `evict(evictable)` returns a tracked key with `evictable(key)` true and stops tracking it, or
  None when no tracked key is evictable: a pinned key is never returned.

S3-FIFO (Yang et al., SOSP 2023): new keys enter a small FIFO (10% of the bytes); a key evicted
from it that was hit meanwhile moves to the main FIFO, otherwise it leaves a ghost entry; a key
inserted again while it is a ghost goes straight to main. Main is a FIFO with up to 3 second
chances. One-hit keys of a scan therefore pass through the small queue without flushing main.

`FairPolicy` runs one of these per tenant, so one tenant cannot flush another's hot set.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Protocol

from kvpool.errors import InvalidArgument
from kvpool.security.tenancy import tenant_of

Evictable = Callable[[str], bool]


class EvictionPolicy(Protocol):
    name: str

    def insert(self, key: str, size: int) -> None: ...

    def access(self, key: str) -> None: ...

    def remove(self, key: str) -> None: ...

    def evict(self, evictable: Evictable) -> str | None: ...

    def __contains__(self, key: object) -> bool: ...

    def __len__(self) -> int: ...


class LRUPolicy:
    """Least recently used first."""

    name = "lru"

    def __init__(self, capacity: int = 0):
        self._order: OrderedDict[str, int] = OrderedDict()

    def insert(self, key: str, size: int) -> None:
        self._order[key] = size
        self._order.move_to_end(key)

    def access(self, key: str) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: str) -> None:
        self._order.pop(key, None)

    def evict(self, evictable: Evictable) -> str | None:
        for key in self._order:
            if evictable(key):
                del self._order[key]
                return key
        return None

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)


class S3FIFOPolicy:
    """Small FIFO + main FIFO + ghost FIFO, sized in bytes from `capacity`."""

    name = "s3fifo"
    SMALL_FRACTION = 0.1
    MAX_FREQ = 3

    def __init__(self, capacity: int):
        if capacity <= 0:
            raise InvalidArgument(f"S3-FIFO needs the tier capacity in bytes, got {capacity!r}")
        self.capacity = capacity
        self._small: OrderedDict[str, int] = OrderedDict()  # key -> size
        self._main: OrderedDict[str, int] = OrderedDict()
        self._ghost: OrderedDict[str, int] = OrderedDict()
        self._freq: dict[str, int] = {}
        self._small_bytes = 0
        self._ghost_bytes = 0

    def insert(self, key: str, size: int) -> None:
        if key in self._freq:
            return
        self._freq[key] = 0
        ghost_size = self._ghost.pop(key, None)
        if ghost_size is not None:
            self._ghost_bytes -= ghost_size
            self._main[key] = size
        else:
            self._small[key] = size
            self._small_bytes += size

    def access(self, key: str) -> None:
        freq = self._freq.get(key)
        if freq is not None and freq < self.MAX_FREQ:
            self._freq[key] = freq + 1

    def remove(self, key: str) -> None:
        if self._freq.pop(key, None) is None:
            return
        size = self._small.pop(key, None)
        if size is not None:
            self._small_bytes -= size
        else:
            self._main.pop(key, None)

    def evict(self, evictable: Evictable) -> str | None:
        # Every step either evicts, moves a key small -> main, or spends one second chance of a
        # main key; pinned keys cycle without spending. Bound the work so an all-pinned tier ends.
        budget = (self.MAX_FREQ + 2) * (len(self._freq) + 1)
        stuck = 0  # main keys in a row that could not go (pinned): past a whole round, try small
        while budget > 0 and self._freq:
            budget -= 1
            if self._small and (self._small_bytes >= self.SMALL_FRACTION * self.capacity or not self._main
                                or stuck >= len(self._main)):
                stuck = 0
                key, size = self._small.popitem(last=False)
                self._small_bytes -= size
                if not evictable(key) or self._freq[key] > 0:
                    self._freq[key] = 0 if evictable(key) else self._freq[key]
                    self._main[key] = size
                    continue
                del self._freq[key]
                self._add_ghost(key, size)
                return key
            key, size = self._main.popitem(last=False)
            if not evictable(key):
                self._main[key] = size
                stuck += 1
                continue
            stuck = 0
            if self._freq[key] > 0:
                self._freq[key] -= 1
                self._main[key] = size
                continue
            del self._freq[key]
            return key
        return None

    def _add_ghost(self, key: str, size: int) -> None:
        self._ghost[key] = size
        self._ghost_bytes += size
        while self._ghost_bytes > (1 - self.SMALL_FRACTION) * self.capacity and self._ghost:
            _, old = self._ghost.popitem(last=False)
            self._ghost_bytes -= old

    def __contains__(self, key: object) -> bool:
        return key in self._freq

    def __len__(self) -> int:
        return len(self._freq)


class ARCPolicy:
    """Adaptive Replacement Cache (Megiddo & Modha, FAST 2003), sized in bytes.

    T1 holds keys seen once recently, T2 keys seen at least twice; B1/B2 remember keys recently
    evicted from each. A miss that hits B1 means T1 was too small: the target `p` for T1 grows;
    a B2 hit shrinks it. So the split between recency and frequency follows the workload, and a
    scan only ever fills T1.

    Here a new key's insert is a write (a put), not a reference as in a read-through cache: a
    key enters T1 unread, its first read refreshes it in T1, its second moves it to T2. Counting
    the write as the first reference sent every prefill-to-decode hand-off (written once, read
    once by the decode worker soon after) to T2 at that read, where consumed hand-offs outranked
    the new ones still waiting for their reader, and with `p` near 0 (nothing re-references an
    evicted hand-off) every eviction took an unread one: a hand-off pattern that LRU served
    fully lost 98% of its reads (tests/kvpool/tiers/test_policy.py). A promotion from SSD is
    inserted too, though a read made it: it usually finds its ghost (its demotion left one) and
    enters T2 as any ghost hit does. Invariant: `_unread` is a subset of T1.
    """

    name = "arc"

    def __init__(self, capacity: int):
        if capacity <= 0:
            raise InvalidArgument(f"ARC needs the tier capacity in bytes, got {capacity!r}")
        self.capacity = capacity
        self.p = 0.0  # target bytes of T1
        self._t1: OrderedDict[str, int] = OrderedDict()
        self._t2: OrderedDict[str, int] = OrderedDict()
        self._b1: OrderedDict[str, int] = OrderedDict()
        self._b2: OrderedDict[str, int] = OrderedDict()
        self._bytes = {"t1": 0, "t2": 0, "b1": 0, "b2": 0}
        self._queues = {"t1": self._t1, "t2": self._t2, "b1": self._b1, "b2": self._b2}
        self._unread: set[str] = set()  # in T1, written and not read since

    def _push(self, name: str, key: str, size: int) -> None:
        self._queues[name][key] = size
        self._bytes[name] += size

    def _pop(self, name: str, key: str | None = None) -> tuple[str, int] | None:
        queue: OrderedDict[str, int] = self._queues[name]
        if key is None:
            if not queue:
                return None
            key, size = queue.popitem(last=False)
        else:
            size = queue.pop(key, None)
            if size is None:
                return None
        self._bytes[name] -= size
        return key, size

    def insert(self, key: str, size: int) -> None:
        if key in self._t1 or key in self._t2:
            return
        b1, b2 = max(1, self._bytes["b1"]), max(1, self._bytes["b2"])
        if self._pop("b1", key) is not None:
            self.p = min(self.capacity, self.p + size * max(1.0, b2 / b1))
            self._push("t2", key, size)
        elif self._pop("b2", key) is not None:
            self.p = max(0.0, self.p - size * max(1.0, b1 / b2))
            self._push("t2", key, size)
        else:
            self._push("t1", key, size)
            self._unread.add(key)

    def access(self, key: str) -> None:
        if key in self._unread:  # its first read: the first reference
            self._unread.discard(key)
            self._t1.move_to_end(key)
            return
        hit = self._pop("t1", key)
        if hit is not None:
            self._push("t2", *hit)
        elif key in self._t2:
            self._t2.move_to_end(key)

    def remove(self, key: str) -> None:
        self._unread.discard(key)
        if self._pop("t1", key) is None:
            self._pop("t2", key)

    def evict(self, evictable: Evictable) -> str | None:
        prefer_t1 = self._t1 and (self._bytes["t1"] > self.p or not self._t2)
        for name in ("t1", "t2") if prefer_t1 else ("t2", "t1"):
            queue: OrderedDict[str, int] = self._queues[name]
            victim = next((k for k in queue if evictable(k)), None)
            if victim is None:
                continue
            _, size = self._pop(name, victim)  # type: ignore[misc]
            self._unread.discard(victim)
            self._push("b1" if name == "t1" else "b2", victim, size)
            self._trim_ghosts()
            return victim
        return None

    def _trim_ghosts(self) -> None:
        while self._b1 and self._bytes["t1"] + self._bytes["b1"] > self.capacity:
            self._pop("b1")
        while self._b2 and sum(self._bytes.values()) > 2 * self.capacity:
            self._pop("b2")

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)


class _Share:
    """One tenant's part of a tier: its inner policy and the bytes of its tracked keys."""

    __slots__ = ("tenant", "policy", "bytes")

    def __init__(self, tenant: str, policy: EvictionPolicy):
        self.tenant, self.policy, self.bytes = tenant, policy, 0


def _bytes(share: _Share) -> int:
    return share.bytes


class FairPolicy:
    """Eviction fair across tenants: one inner policy per tenant (`tenant_of`), and a victim is
    taken first from the tenant holding the most bytes of the tier, that is the one most over
    its fair share (the capacity split evenly among the tenants present). A tenant flooding the
    tier therefore evicts its own objects before another tenant's working set; within a tenant
    the inner policy (LRU, S3-FIFO, ARC) decides. With one tenant (authentication off, unscoped
    keys) it is exactly the inner policy.

    A key's tenant is derived once, when it is first inserted: each tracked key maps to its
    tenant's share, so an access (every get) or a removal costs one lookup by the key, not a
    `tenant_of` (a slice of the key and a hash of the new string, for every scoped key).

    Invariants (besides the Protocol's): `bytes_of(t)` is the sum of the sizes of t's tracked
    keys; a tracked key's share is that of `tenant_of(key)`; a victim comes from a tenant with at
    least as many bytes as every tenant that had an evictable key."""

    def __init__(self, make: Callable[[], EvictionPolicy]):
        self._make = make
        first = make()
        self.name = first.name
        self._shares: dict[str, _Share] = {"": _Share("", first)}
        self._held: dict[str, tuple[_Share, int]] = {}  # tracked key -> (its tenant's share, its size)

    def bytes_of(self, tenant: str) -> int:
        share = self._shares.get(tenant)
        return share.bytes if share is not None else 0

    def insert(self, key: str, size: int) -> None:
        held = self._held.get(key)
        if held is not None:
            held[0].policy.insert(key, size)
            return
        tenant = tenant_of(key)
        share = self._shares.get(tenant)
        if share is None:
            share = self._shares[tenant] = _Share(tenant, self._make())
        share.policy.insert(key, size)
        self._held[key] = (share, size)
        share.bytes += size

    def access(self, key: str) -> None:
        held = self._held.get(key)
        if held is not None:
            held[0].policy.access(key)

    def remove(self, key: str) -> None:
        held = self._held.pop(key, None)
        if held is None:
            return
        share, size = held
        share.policy.remove(key)
        share.bytes -= size

    def evict(self, evictable: Evictable) -> str | None:
        shares = self._shares
        order = shares.values() if len(shares) == 1 else sorted(shares.values(), key=_bytes, reverse=True)
        for share in order:
            victim = share.policy.evict(evictable)
            if victim is not None:
                share.bytes -= self._held.pop(victim)[1]
                return victim
        return None

    def __contains__(self, key: object) -> bool:
        return key in self._held

    def __len__(self) -> int:
        return len(self._held)


POLICIES: dict[str, type] = {"lru": LRUPolicy, "s3fifo": S3FIFOPolicy, "arc": ARCPolicy}


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """A fresh policy by name ("lru" | "s3fifo" | "arc") for a tier of `capacity` bytes."""
    cls = POLICIES.get(name)
    if cls is None:
        raise InvalidArgument(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}")
    return cls(capacity)
