"""`TieredStore`: the tiers of one node behind one thread-safe object.

Objects are written into DRAM (the shared-memory arena), demoted to SSD when DRAM evicts them,
and promoted back to DRAM when read from SSD. SSD copies are kept after promotion (a clean
object's later eviction from DRAM then costs no write).

Concurrency: one lock guards the index, the tiers' metadata and the policies. Bulk copies
(a put's bytes into the arena, a get's bytes out of it, an SSD read during promotion) run
outside the lock, except copies of at most `SMALL_COPY` bytes, which are cheaper than the
extra lock round trip; what the unlocked copies touch is protected by state instead:
- a get pins the object first (`pins > 0`): a pinned object is never evicted and never freed;
  a `remove` of a pinned object hides it at once and frees its space at the last unpin;
- a put or promotion owns a DRAM reservation that nobody else may place data in, commit or
  abort; `promoting` keeps the SSD copy from being evicted and makes `remove` defer to the
  promoter, which aborts the reservation.
The hook `on_event(key, event)` ("stored" | "removed" | "demoted" | "promoted") is called after
the lock is released, in the thread that caused the event.

Invariants: a visible object (`contains`) reads back exactly the bytes of the put that stored
it; every tier's `used <= capacity`; a key is visible iff it is committed, not being removed,
and held by DRAM or SSD.

Keys: `put`, `get`, `get_into`, `pin`, `remove` validate theirs; `reserve`,
`commit`, `abort`, `contains`, `size_of` trust theirs (validated once by `kvpool.node.writes`).
Pins do not expire: whoever pins (the node, for a same-host reader or a transfer) unpins, also
when its peer goes away. KV in GPU memory is the engine's own (vLLM's blocks, the reference
worker's prefix cache); the pool's tiers are host DRAM and SSD.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Callable, Iterator, Sequence

from kvpool.config import DEFAULT_EVICTION
from kvpool.contract import check_stored_key as check_key
from kvpool.security.keyring import load_keyring
from kvpool.errors import AllPinned, AlreadyExists, CapacityError, InvalidArgument, KeyNotFound, ObjectTooLarge
from kvpool.tiers.base import Location, Reservation
from kvpool.shm.views import readable_view, writable_view
from kvpool.tiers.dram import DramTier
from kvpool.tiers.entries import Entry as _Entry, EntryIndex
from kvpool.tiers.policy import FairPolicy, make_policy
from kvpool.tiers.ssd import SsdShelf, SsdTier
from kvpool.tiers.stats import StoreStats
from kvpool.tiers.tenants import check_quota, tenant_quotas

log = logging.getLogger(__name__)

EventHook = Callable[[str, str], None]
# Copies up to this size run under the lock: a 256 KiB memcpy (~10-20 us) costs less than the
# second lock round trip and pin bookkeeping it saves; larger copies run outside it, pinned.
SMALL_COPY = 256 << 10


class TieredStore:
    """DRAM arena (+ optional SSD) with eviction, demotion, promotion and pins."""

    def __init__(self, dram_capacity: int, ssd_path: str | None = None, ssd_capacity: int = 0,
                 policy: str = DEFAULT_EVICTION, *, index_slots: int = -1,
                 quotas: dict[str, tuple[int, int]] | None = None):
        """`quotas`: tenant -> (bytes, keys) it may hold on this node (0: no limit); a reservation
        past either raises `QuotaExceeded`. Eviction is fair across tenants (`FairPolicy`)."""
        if ssd_path is not None and ssd_capacity <= 0:
            raise InvalidArgument("an SSD tier needs ssd_capacity > 0")
        self._lock = threading.Lock()
        self._promoted = threading.Condition(self._lock)  # notified when a promotion ends
        self.quotas = dict(quotas or {})
        dram_cap = max(1, dram_capacity)
        self._dram_policy = FairPolicy(lambda: make_policy(policy, dram_cap))  # validates the name first
        self.policy = policy
        self.dram = DramTier(dram_capacity, index_slots=index_slots)
        self.ssd: SsdTier | None = None
        try:
            if ssd_path is not None:
                self.ssd = SsdTier(ssd_path, ssd_capacity)
        except BaseException:
            self.close()
            raise
        self.on_event: EventHook | None = None
        self._entries: EntryIndex = EntryIndex()
        self._stats = StoreStats()
        self._shelf: SsdShelf | None = None
        if self.ssd is not None:  # objects that survived a restart are visible again
            ssd_cap = self.ssd.capacity
            self._shelf = SsdShelf(self.ssd, FairPolicy(lambda: make_policy(policy, ssd_cap)), self._stats.ssd)
            for key, size in self.ssd.keys():
                self._entries[key] = _Entry(size, ssd=True)

    @classmethod
    def from_settings(cls, settings: Any) -> "TieredStore":
        """A store as `kvpool.config.Settings` describe it (`[node]`: capacities, ssd_path,
        eviction, the shm index; `[rpc] shm_index`; the keyring's quotas)."""
        node, auth_file = settings.node, settings.security.auth_file
        ssd_capacity = node.ssd_capacity if node.ssd_path else 0
        return cls(node.dram_capacity, node.ssd_path, ssd_capacity, node.eviction,
                   index_slots=node.shm_index_slots if settings.rpc.shm_index else 0,
                   quotas=tenant_quotas(load_keyring(auth_file)) if auth_file else None)

    @property
    def arena(self):
        return self.dram.arena

    # -- writes ----------------------------------------------------------------------------
    def put(self, key: str, data: Any) -> None:
        """Store `data` under `key`; a key already stored is left as it is (first writer wins)."""
        src = readable_view(data)
        check_key(key)
        events: list = []
        try:  # demotions done before a failure still happened: report them either way
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None and entry.visible:
                    return
                res = self._reserve_locked(key, src.nbytes, events)
                small = res.length <= SMALL_COPY
                if small:  # cheaper than a second lock round trip
                    self.dram.arena.buffer[res.offset : res.offset + res.length] = src
                    self._commit_locked(key, self._entries[key], events)
        finally:
            self._fire(events)
        if small:
            return
        try:
            self.dram.arena.buffer[res.offset : res.offset + res.length] = src
        except BaseException:
            self.abort(key)
            raise
        self.commit(key)

    def reserve(self, key: str, size: int) -> Reservation:
        """Reserve `size` bytes in the arena for a writer; invisible until `commit` (`key`: trusted)."""
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise InvalidArgument(f"size must be a positive int, got {size!r}")
        events: list = []
        try:
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None and entry.visible:
                    raise AlreadyExists(f"key {key!r} is already stored")
                return self._reserve_locked(key, size, events)
        finally:
            self._fire(events)

    def commit(self, key: str) -> None:
        """Make a reserved object visible (its bytes are not checked: readers verify chunks)."""
        events: list = []
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or not entry.writing:
                raise KeyNotFound(f"no reservation for {key!r}")
            self._commit_locked(key, entry, events)
        self._fire(events)

    def _commit_locked(self, key: str, entry: _Entry, events: list) -> None:
        self.dram.commit(key)
        entry.writing, entry.dram = False, True
        self._dram_policy.insert(key, entry.size)
        self._stats.dram.bytes_in += entry.size
        events.append((key, "stored"))

    def abort(self, key: str) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.writing:
                self.dram.abort(key)
                del self._entries[key]

    def _reserve_locked(self, key: str, size: int, events: list) -> Reservation:
        if size > self.dram.capacity:
            raise ObjectTooLarge(f"object of {size} bytes exceeds the DRAM tier ({self.dram.capacity} bytes)")
        if key in self._entries:
            raise AlreadyExists(f"key {key!r} is being written or removed; retry later")
        if self.quotas:
            check_quota(self.quotas, self._entries.usage, key, size)
        res = self._make_room(key, size, events)
        self._entries[key] = _Entry(size, writing=True)
        return res

    def usage(self, tenant: str) -> tuple[int, int]:
        """(bytes, keys) `tenant` holds in this store ("" for unscoped keys)."""
        with self._lock:
            used_bytes, used_keys = self._entries.usage.get(tenant, (0, 0))
        return used_bytes, used_keys

    def _make_room(self, key: str, size: int, events: list) -> Reservation:
        """A DRAM reservation of `size` bytes, evicting (demoting) unpinned objects as needed."""
        while True:
            res = self.dram.try_reserve(key, size)
            if res is not None:
                return res
            victim = self._dram_policy.evict(lambda k: self._entries[k].pins == 0)
            if victim is None:
                if any(e.pins for e in self._entries.values()):
                    raise AllPinned(f"no room for {size} bytes in DRAM: every evictable object is pinned")
                raise CapacityError(f"no room for {size} bytes in DRAM (space held by writes in flight)")
            self._demote(victim, events)

    def _demote(self, key: str, events: list) -> None:
        entry = self._entries[key]
        self._stats.dram.evictions += 1
        if self._shelf is not None and not entry.ssd:
            entry.ssd, evicted = self._shelf.put(key, self.dram.view(key), entry.size,
                                                 lambda k: not self._entries[k].promoting)
            for victim in evicted:  # SSD made room: what was only there is gone
                gone = self._entries[victim]
                gone.ssd = False
                if not gone.dram:
                    del self._entries[victim]
                    events.append((victim, "removed"))
        self.dram.remove(key)
        entry.dram = False
        if entry.ssd:
            events.append((key, "demoted"))
        else:
            del self._entries[key]
            events.append((key, "removed"))

    def remove(self, key: str) -> bool:
        """Remove `key` from every tier; True if it was visible. A pinned object's space is
        freed when its last pin goes."""
        check_key(key)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or not entry.visible:
                return False
            if entry.ssd:
                self._shelf.drop(key)
                entry.ssd = False
            if entry.dram:
                self._dram_policy.remove(key)
                if entry.pins == 0:
                    self.dram.remove(key)
                    entry.dram = False
                else:  # freed at the last unpin; index readers must stop finding it now
                    self.dram.unpublish(key)
            entry.removing = entry.dram or entry.promoting
            if not entry.removing:
                del self._entries[key]
        self._fire([(key, "removed")])
        return True

    # -- reads -----------------------------------------------------------------------------
    def get_into(self, key: str, buffer: Any) -> int:
        """Copy the object into `buffer`; return its size. `KeyNotFound` on a miss."""
        check_key(key)
        loc: Location | None = None
        res: Reservation | None = None
        events: list = []
        with self._lock:  # _start_promotion never raises: events are fired below
            entry = self._entries.get(key)
            if entry is None or not entry.visible:
                self._stats.absent_read()
                raise KeyNotFound(key)
            size = entry.size
            dst = writable_view(buffer, size)[:size]
            if entry.dram:
                self._dram_policy.access(key)
                self._stats.dram.hit(size)
                loc = self.dram.location(key)
                if size <= SMALL_COPY:  # cheaper than pin + a second lock round trip
                    dst[:] = self.dram.arena.buffer[loc.offset : loc.offset + size]
                    return size
                entry.pins += 1  # pinned: the copy below runs outside the lock
            else:
                self._stats.dram.misses += 1
                res = self._start_promotion(key, entry, events)
        if loc is not None:
            try:
                dst[:] = self.dram.arena.buffer[loc.offset : loc.offset + size]
            finally:
                self.unpin(key)
            return size
        self._fire(events)
        self._read_ssd(key, dst, res)
        return size

    def _start_promotion(self, key: str, entry: _Entry, events: list, must: bool = False) -> Reservation | None:
        """Reserve DRAM for an SSD object (lock held); None when another promotion is in flight
        or, unless `must` (a pin), DRAM is all pinned (the read is then served from SSD alone)."""
        self._shelf.policy.access(key)
        if entry.promoting:
            return None
        # Flag first: making room may demote into SSD, and that must not evict this object's
        # own SSD copy (promoting objects are not SSD-evictable).
        entry.promoting = True
        try:
            return self._make_room(key, entry.size, events)
        except BaseException as exc:
            entry.promoting = False
            self._promoted.notify_all()
            if must or not isinstance(exc, CapacityError):
                raise
            return None

    def _read_ssd(self, key: str, dst: memoryview, res: Reservation | None, pin: bool = False) -> None:
        """Read an SSD object into `dst` outside the lock, then finish its promotion into `res`
        (when `pin`, `dst` is the reservation itself and the object stays pinned).
        Raises KeyNotFound when the copy is gone or damaged, or a pin's promotion was cancelled."""
        try:
            ok = self.ssd.get_into(key, dst) == len(dst)
        except KeyNotFound:
            ok = False
        if ok and res is not None and not pin:
            self.dram.arena.buffer[res.offset : res.offset + res.length] = dst
        promoted = False
        events: list = []
        with self._lock:
            entry = self._entries.get(key)
            if ok:
                self._stats.ssd.hit(len(dst))
            else:
                self._stats.ssd.misses += 1
            if res is not None and entry is not None:
                promoted = self._finish_promotion(key, entry, ok, pin, events)
                self._promoted.notify_all()
            elif not ok and entry is not None and entry.ssd and not self.ssd.contains(key):
                self._forget_ssd_copy(key, entry, events)  # the SSD tier dropped a damaged copy
        self._fire(events)
        if not ok or (pin and not promoted):
            raise KeyNotFound(key)

    def _finish_promotion(self, key: str, entry: _Entry, ok: bool, pin: bool, events: list) -> bool:
        """Commit (True) or cancel (False) a promotion; lock held."""
        entry.promoting = False
        if ok and not entry.removing:
            self.dram.commit(key)
            entry.dram = True
            entry.pins += 1 if pin else 0
            self._dram_policy.insert(key, entry.size)
            self._stats.dram.bytes_in += entry.size
            events.append((key, "promoted"))
            return True
        self.dram.abort(key)
        if not ok and entry.ssd:
            self._forget_ssd_copy(key, entry, events)
        elif entry.removing or not (entry.dram or entry.ssd):
            del self._entries[key]
        return False

    def _forget_ssd_copy(self, key: str, entry: _Entry, events: list) -> None:
        """The SSD copy is gone or damaged (lock held): so is the key unless DRAM holds or gets it."""
        entry.ssd = False
        self._shelf.policy.remove(key)
        if not (entry.dram or entry.promoting):
            del self._entries[key]
            events.append((key, "removed"))

    def get(self, key: str) -> bytes | None:
        """The object's bytes, or None on a miss."""
        check_key(key)
        for _ in range(3):  # the key may be removed and re-put with another size meanwhile
            out = bytearray(self.size_of(key) or 0)  # a miss is counted (and raised) by get_into
            try:
                return bytes(memoryview(out)[: self.get_into(key, out)])
            except KeyNotFound:
                return None
            except InvalidArgument:  # stored since it was sized, or re-put larger: size again
                continue
        return None

    def hide(self, key: str) -> None:
        """Keep `key` stored but out of the shm index: same-host readers must ask the node."""
        with self._lock:
            self.dram.unpublish(key)

    def touch(self, keys: Sequence[str]) -> None:
        """Count reads that same-host readers served themselves through the shm index (they
        report them in batches): DRAM hits, and recency for the eviction policy."""
        with self._lock:
            stats = self._stats.dram
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None and entry.dram and entry.visible:
                    self._dram_policy.access(key)
                    stats.hit(entry.size)

    # -- pins ------------------------------------------------------------------------------
    def pin(self, key: str) -> Location:
        """Keep `key` in DRAM (promoting it from SSD if needed) until `unpin`; its bytes are at
        `Location` in `arena`. Raises KeyNotFound, or AllPinned when DRAM has no room.
        A pin racing another reader's promotion of the same key waits for it.
        The key is validated only when it is not found (no invalid key is ever stored): a
        tenant's key, validated at the RPC dispatch, was checked here again on every get, and
        its scoped form costs a regex (~2,200 instructions, a tenant's 64 KiB get ~3%)."""
        events: list = []
        self._lock.acquire()  # not `with`: the hook must run after the release, also on errors
        try:
            while True:
                entry = self._entries.get(key) if type(key) is str else None
                if entry is None or not entry.visible:
                    check_key(key)  # a malformed key is told as such, not as a miss
                    raise KeyNotFound(key)
                if entry.dram:
                    entry.pins += 1
                    self._dram_policy.access(key)
                    self._stats.dram.hit(entry.size)
                    return self.dram.location(key)  # type: ignore[return-value]
                if not entry.promoting:
                    break
                self._promoted.wait(timeout=1.0)  # another reader is promoting it: share its result
            res = self._start_promotion(key, entry, events, must=True)
        finally:
            self._lock.release()
            self._fire(events)
        view = self.dram.arena.buffer[res.offset : res.offset + res.length]
        self._read_ssd(key, view, res, pin=True)
        return Location(res.offset, res.length, from_ssd=True)

    def unpin(self, key: str) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.pins == 0:
                raise InvalidArgument(f"{key!r} is not pinned")
            entry.pins -= 1
            if entry.pins == 0 and entry.removing and not entry.promoting:
                self.dram.remove(key)
                del self._entries[key]

    @contextlib.contextmanager
    def pinned(self, key: str) -> Iterator[Location]:
        loc = self.pin(key)
        try:
            yield loc
        finally:
            self.unpin(key)

    # -- queries ---------------------------------------------------------------------------
    def resident(self, keys: Sequence[str], prefix: str = "") -> bool:
        """Whether a pin of each of `prefix + key` would be served from DRAM now, with no SSD
        read and no wait for a promotion (a key not held counts: its miss is quick). Advisory,
        without the lock: a pin racing a change still answers correctly, only maybe slower."""
        entries = self._entries
        for key in keys:
            entry = entries.get(prefix + key if prefix else key)
            if entry is not None and (not entry.dram or entry.promoting):
                return False
        return True

    def contains(self, key: str) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.visible

    def size_of(self, key: str) -> int | None:
        entry = self._entries.get(key)
        return entry.size if entry is not None and entry.visible else None

    def keys(self) -> Iterator[tuple[str, int, str]]:
        """(key, size, fastest tier holding it) of every visible object (a snapshot)."""
        with self._lock:
            return iter([(k, e.size, "dram" if e.dram else "ssd") for k, e in self._entries.items() if e.visible])

    def stats(self) -> dict[str, Any]:
        """{"policy", "tiers": {name: {capacity, used, objects, hits, misses, ...}}, "total": {...}}
        (`kvpool.tiers.stats.StoreStats.report`)."""
        with self._lock:
            return self._stats.report(self.policy, {"dram": self.dram, "ssd": self.ssd},
                                      self._entries)

    # -- lifecycle -------------------------------------------------------------------------
    def _fire(self, events: list) -> None:
        if (hook := self.on_event) is None:
            return
        for key, event in events:
            try:
                hook(key, event)
            except Exception:  # a broken listener must not break the data path
                log.exception("on_event hook failed for %s %s", event, key)

    def close(self) -> None:
        """Unmap and unlink the arena, close lmdb. Later calls raise or misbehave: close last."""
        with self._lock:
            for tier in (getattr(self, "ssd", None), getattr(self, "dram", None)):
                if tier is not None:
                    tier.close()

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

