"""The one chunk reader: every adapter and worker reads chunk objects from the pool through it.

`ChunkReader(pool, layout, auth=...)` fetches chunk objects in batches, verifies each one (header,
binding to our namespace and to the key it was read from, MAC when `auth` has a MAC key, layout
hash, checksum, token count) and hands out `kvpool.chunk_format.ChunkView`s: layer-major payload
views, so a caller can place layer i of a chunk before it looks at layer i + 1.

The one rule for a chunk that fails: it is a miss, never KV, and it is counted (`damaged`) and
logged. Whether the reader also removes it depends on whether the chunk is provably ours, since
a removal on a failed check is a deletion anyone who can put bytes there (or name a key in a
forged handle) could trigger:
- With a MAC key (a keyring): never removed. A chunk that fails the MAC, names another namespace
  or key, or holds another token count than expected is reported (`rejected`, and
  `on_rejected(key, error)`) and left in place; it leaves the pool by eviction or an admin's
  removal. Nothing a writer without the tenant's key does, and nothing a handle names, makes this
  reader delete an object. The price: a chunk of ours damaged in storage stays a miss (recomputed
  on every use) until it is evicted, since a put never overwrites.
- Without a MAC key (authentication off, where anyone local may remove any key anyway): removed
  only when its header names our namespace and this very key (our chunk, damaged: checksum,
  layout or token count), so the next save of the same tokens heals it (chunk keys are content
  addressed and a put never overwrites: a damaged copy left in place would be a miss forever);
  reported through `on_removed(key)`. A malformed header (a version 1 chunk included), another
  namespace or another key is rejected as above and left in place: a forged handle naming
  another tenant's key deletes nothing.
With authentication on, the pool also scopes keys per tenant principal, so a reader never even
sees another tenant's objects.

A layout with a codec (`KVLayout.codec`, `kvpool.codec`): each chunk is decoded as it is
verified, and the views hold the decoded KV; a chunk of another codec is another layout (a miss).

Three forms, one rule:
- `run(keys)`: the longest intact run keys[0..n) (a prefix of a prompt); it stops fetching at
  the first miss.
- `read(keys, tokens)`: per key, its view or None (a page store such as SGLang's, where any key
  may miss on its own).
- `exact(keys, tokens)`: all or nothing (a KV handle): `KeyNotFound` for a missing object,
  `CorruptObject` for one that fails (after removing it where the rule above says so).

Each view says which pool tier served it (`ChunkView.tier`: "dram" | "ssd"), when the pool
client reports it (`get_batch(keys, tiers=...)`, kvpool's clients do): hit counters by tier.

Pool errors (`KVPoolError` from the client) are raised to the caller, which decides whether a
failed read is a miss (the engine plug-ins) or a failed request.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, Iterator, Sequence

from kvpool.chunk_format import ChunkAuth, ChunkView, KVLayout, decode_chunk, key_digest, read_header
from kvpool.codec import get_codec
from kvpool.errors import CorruptObject, InvalidArgument, KeyNotFound, KVPoolError, LayoutMismatch

log = logging.getLogger(__name__)

BATCH_BYTES = 48 << 20  # one get_batch asks for about this much: few round trips, no more than a node stages at once
ANY_TOKENS = 0  # `read(keys, ANY_TOKENS)`: accept any token count the layout allows (a store whose keys do
# not say how many tokens a chunk holds, such as LMCache's, whose last chunk of a prompt may be partial)


class ChunkReader:
    """Verified reads of chunk objects of one `KVLayout`. Safe to share between threads (the pool
    client is); `fetched`, `damaged` and `rejected` are statistics, not exact under concurrent reads.
    `auth` is required: every read checks that a chunk names our namespace and its key."""

    def __init__(self, pool: Any, layout: KVLayout, *, auth: ChunkAuth,
                 on_removed: Callable[[str], None] | None = None,
                 on_rejected: Callable[[str, Exception], None] | None = None):
        if not isinstance(auth, ChunkAuth):
            raise TypeError("ChunkReader needs auth=ChunkAuth(namespace digest, mac key or None)")
        self.pool = pool
        self.layout = layout
        self.auth = auth
        # a layout with a codec (kvpool.codec) is decoded here, so a payload that does not decode is a miss too
        self.codec = get_codec(layout.codec) if layout.codec != "none" else None
        self.on_removed = on_removed
        self.on_rejected = on_rejected
        self.batch_chunks = max(1, BATCH_BYTES // layout.object_nbytes())
        self._tiered = _takes_tiers(pool)  # the client can say which tier served each key
        self.fetched = 0  # verified chunks handed out
        self.damaged = 0  # chunks that failed verification (removed or rejected)
        self.rejected = 0  # of those, left in place: not provably ours (see the module docstring)

    def match(self, keys: Sequence[str]) -> int:
        """n such that keys[0..n) are all in the pool (one match_prefix round trip)."""
        return int(self.pool.match_prefix(list(keys))) if keys else 0

    # -- the three forms -----------------------------------------------------------------------

    def run(self, keys: Sequence[str]) -> list[ChunkView]:
        """Views of keys[0..n), the longest intact run of full chunks."""
        views = []
        for key, blob, tier in self._fetch(keys, stop_at_miss=True):
            view = self._verify(key, blob, self.layout.chunk_tokens, tier) if blob is not None else None
            if view is None:
                break
            views.append(view)
        self.fetched += len(views)
        return views

    def read(self, keys: Sequence[str], tokens: int | None = None, *,
             into: Sequence[Any] | None = None) -> list[ChunkView | None]:
        """Per key: its verified view (holding `tokens` tokens, default a full chunk; `ANY_TOKENS`:
        however many it holds) or None. `into`: one writable buffer per key, each at least
        `layout.object_nbytes()`, that the chunks are read into (no new memory per read; the views
        are valid until the caller reuses the buffers)."""
        want = self.layout.chunk_tokens if tokens is None else tokens
        if into is not None and len(into) != len(keys):
            raise InvalidArgument(f"{len(keys)} keys but {len(into)} buffers")
        out: list[ChunkView | None] = []
        for key, blob, tier in self._fetch(keys, stop_at_miss=False, into=into):
            view = self._verify(key, blob, want, tier) if blob is not None else None
            self.fetched += view is not None
            out.append(view)
        return out

    def exact(self, keys: Sequence[str], tokens: Sequence[int]) -> list[ChunkView]:
        """Views of every key, each holding the given token count; all or nothing."""
        views = []
        for (key, blob, tier), want in zip(self._fetch(keys, stop_at_miss=True), tokens):
            if blob is None:
                raise KeyNotFound(f"KV object {key} is not in the pool (evicted, expired or released)")
            view = self._verify(key, blob, want, tier)
            if view is None:
                raise CorruptObject(f"KV object {key} failed verification (damaged, or not written by this "
                                    "tenant's workers for this key)")
            views.append(view)
        self.fetched += len(views)
        return views

    # -- the rule --------------------------------------------------------------------------------

    def _verify(self, key: str, blob: Any, tokens: int, tier: str = "") -> ChunkView | None:
        try:
            view = decode_chunk(blob, self.layout, key=key, auth=self.auth, codec=self.codec)
            if tokens != ANY_TOKENS and view.tokens != tokens:
                raise CorruptObject(f"holds {view.tokens} tokens, expected {tokens}")
            view.tier = tier
            return view
        except (CorruptObject, LayoutMismatch) as exc:
            self.discard(key, exc, ours=not self.auth.keyed and self._names_us(key, blob))
            return None

    def _names_us(self, key: str, blob: Any) -> bool:
        """The header parses and names our namespace and this key (all an unkeyed reader can know)."""
        try:
            header = read_header(blob)
        except CorruptObject:
            return False
        return header.namespace == bytes(self.auth.namespace) and header.key_digest == key_digest(key)

    def discard(self, key: str, why: Exception, *, ours: bool = False) -> None:
        """A stored object failed verification: count it, and remove it (so a later save can store
        a good copy) only when it is provably our own damaged chunk (module docstring); otherwise
        report it and leave it. Best effort: a failed removal is logged."""
        self.damaged += 1
        if not ours or self.auth.keyed:
            self.rejected += 1
            log.warning("chunk %s rejected (%s); a miss, left in the pool (not provably ours to remove)", key, why)
            if self.on_rejected is not None:
                self.on_rejected(key, why)
            return
        log.warning("chunk %s failed verification (%s); removing it and treating it as a miss", key, why)
        try:
            # Our own read holds a lease that would defer the removal (and make the re-store of a
            # good copy find the key busy); clients that release leases lazily send them now.
            flush = getattr(self.pool, "flush", None)
            if callable(flush):
                flush()
            removed = self.pool.remove(key)
        except KVPoolError as exc:
            log.warning("could not remove damaged chunk %s: %s", key, exc)
            return
        if removed and self.on_removed is not None:
            self.on_removed(key)

    # -- fetching --------------------------------------------------------------------------------

    def _fetch(self, keys: Sequence[str], *, stop_at_miss: bool,
               into: Sequence[Any] | None = None) -> Iterator[tuple[str, Any, str]]:
        """(key, bytes or None, tier or "") in order, `batch_chunks` keys per get_batch (or
        get_batch_into the caller's buffers `into`, tier unknown). A miss inside a batch is retried
        alone once: a node may decline a batch larger than it can stage at once (SSD objects are
        promoted through DRAM) yet serve the same objects one by one."""
        keys = list(keys)
        for start in range(0, len(keys), self.batch_chunks):
            group = keys[start:start + self.batch_chunks]
            if into is None:
                blobs, tiers = self._get_batch(group)
            else:
                blobs, tiers = self._get_group(group, into[start:start + len(group)]), [""] * len(group)
            for key, blob, tier in zip(group, blobs, tiers):
                if blob is None and len(group) > 1:
                    if self._tiered:
                        (blob,), (tier,) = self._get_batch([key])
                    else:
                        blob = self.pool.get(key)
                yield key, blob, tier
                if blob is None and stop_at_miss:
                    return

    def _get_batch(self, keys: list[str]) -> tuple[list[Any], list[str]]:
        if not self._tiered:
            return self.pool.get_batch(keys), [""] * len(keys)
        tiers: list[str] = []
        blobs = self.pool.get_batch(keys, tiers=tiers)
        return blobs, tiers

    def _get_group(self, group: list[str], buffers: Sequence[Any]) -> list[Any]:
        try:
            sizes = self.pool.get_batch_into(group, buffers)
        except InvalidArgument:  # an object larger than any chunk of this layout: read it to reject it
            return self.pool.get_batch(group)
        return [memoryview(b).cast("B")[:n] if n >= 0 else None for b, n in zip(buffers, sizes)]


def _takes_tiers(pool: Any) -> bool:
    """Whether `pool.get_batch` accepts `tiers=` (kvpool's clients; a plain PoolClient need not)."""
    try:
        return "tiers" in inspect.signature(pool.get_batch).parameters
    except (AttributeError, TypeError, ValueError):
        return False
