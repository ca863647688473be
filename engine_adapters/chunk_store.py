"""The engine-free half of every adapter: keys, lookups, verified reads (through the one
`ChunkReader`), planned and batched writes, KV handles and events.

An adapter owns one `ChunkStore` and only converts between its engine's KV and `ChunkView`s /
payload buffers, answering the contract methods that need no engine format from it.
The contract itself, and the invariants kept here, are in `engine_adapters.base`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import numpy as np

from engine_adapters.base import KVEvent, SaveResult
from engine_adapters.chunk_reader import ChunkReader
from kvpool.chunk_format import ChunkAuth, ChunkView, decode_chunk, encode_chunk, payload_tensor, seal_into
from kvpool.security.keyring import chunk_mac_key, load_keyring, tenant_salt
from kvpool.config import current_settings, read_secret_file
from kvpool.contract import PoolClient
from kvpool.errors import AlreadyExists, CorruptObject, InvalidArgument, KVPoolError, LayoutMismatch
from kvpool.handle import KVHandle
from kvpool.keys import Namespace, chunk_keys_hex, tail_key

log = logging.getLogger(__name__)

BUSY_RETRY_S = 1.0  # how long a save retries a chunk the pool reports busy (AlreadyExists)


@dataclass
class PlannedObject:
    """One chunk object a save will write: tokens [start, start + tokens) under `key`."""

    key: str
    start: int
    tokens: int
    is_tail: bool
    buffer: bytearray


def plugin_mac_key(keyring=None) -> bytes | None:
    """The chunk MAC key of an engine plug-in (vLLM connector, SGLang backend), which serves one
    principal: with a keyring (`KVPOOL_AUTH_FILE`), the key derived from the secret of the
    principal its pool client authenticates as (`KVPOOL_PRINCIPAL`; a tenant's, so its chunks are
    those of that tenant's workers); without one, None (unkeyed chunks)."""
    keyring = keyring if keyring is not None else load_keyring()
    return chunk_mac_key(keyring.credential().secret) if keyring is not None else None


def plugin_tenant_salt(extra: dict, keyring=None) -> str:
    """The namespace salt of an engine plug-in (vLLM connector, SGLang backend). With a keyring
    whose plug-in principal (`KVPOOL_PRINCIPAL`) is a tenant: that tenant's derived salt, the one
    the router and the reference workers use for it. Otherwise, first found: the file named by
    `tenant_salt_file` in the plug-in's extra config, `[security] tenant_salt` (KVPOOL_TENANT_SALT,
    or read from KVPOOL_TENANT_SALT_FILE), then `tenant_salt` itself (accepted, with a warning: an
    engine's JSON config is usually on its argv, which every user of the machine reads in `ps`)."""
    keyring = keyring if keyring is not None else load_keyring()
    if keyring is not None:
        entry = keyring.entries[keyring.credential().principal]
        if entry.principal.tenant:
            return tenant_salt(entry.principal.tenant, entry.secret)
    if extra.get("tenant_salt_file"):
        return read_secret_file(str(extra["tenant_salt_file"]), "tenant_salt_file")
    configured = current_settings().security.tenant_salt
    if configured:
        return configured
    salt = str(extra.get("tenant_salt", ""))
    if salt:
        log.warning("tenant_salt given inline in the engine's kv config: anyone who can run `ps` reads it; "
                    "use tenant_salt_file or KVPOOL_TENANT_SALT_FILE")
    return salt


def check_token_ids(token_ids: Sequence[int]) -> list[int]:
    """Token ids as a list of ints; anything else (floats, strings, nesting, out of u32) is refused
    rather than rounded, since a silently changed id would key another prompt's KV."""
    try:
        arr = np.asarray(token_ids)
    except (TypeError, ValueError):
        raise InvalidArgument("token ids must be a sequence of integers") from None
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidArgument(f"token ids must be a flat sequence of integers, got {arr.dtype} of shape {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
        raise InvalidArgument("token ids must be in 0..2**32-1")
    return arr.tolist()


class ChunkStore:
    """The engine-free half of an adapter (module docstring). Thread-safe for concurrent requests
    (the pool client is; listeners are called from the thread that made the change, outside any
    lock).

    Every chunk it writes names its namespace and key and, given `mac_key` (the tenant's
    `kvpool.security.keyring.chunk_mac_key`, with a keyring), carries a MAC under it; its reader accepts only
    such chunks (`engine_adapters.chunk_reader`).
    """

    def __init__(self, pool: PoolClient, namespace: Namespace, *, mac_key: bytes | None = None):
        self.pool = pool
        self.namespace = namespace
        self.layout = namespace.layout
        self.chunk_tokens = namespace.layout.chunk_tokens
        self._ns_digest = namespace.digest()
        self.namespace_hex = self._ns_digest.hex()
        self.auth = ChunkAuth(self._ns_digest, mac_key)
        self._listeners: list[Callable[[KVEvent], None]] = []
        self._lock = threading.Lock()
        self.reader = ChunkReader(pool, self.layout, auth=self.auth, on_removed=self._removed)

    # -- keys and lookups -------------------------------------------------------------------

    def chunk_keys(self, token_ids: Sequence[int]) -> list[str]:
        return chunk_keys_hex(self._ns_digest, check_token_ids(token_ids), self.chunk_tokens)

    def _capped_keys(self, token_ids: Sequence[int], max_tokens: int | None) -> list[str]:
        ids = check_token_ids(token_ids)
        if max_tokens is not None:
            if max_tokens < 0:
                raise InvalidArgument(f"max_tokens must be >= 0, got {max_tokens}")
            ids = ids[:max_tokens]
        return self.chunk_keys(ids)

    def lookup(self, token_ids: Sequence[int], max_tokens: int | None = None) -> int:
        """Tokens (a multiple of chunk_tokens) of the longest cached prefix: one match_prefix call."""
        keys = self._capped_keys(token_ids, max_tokens)
        return self.pool.match_prefix(keys) * self.chunk_tokens if keys else 0

    # -- reading ----------------------------------------------------------------------------

    def _flush_releases(self) -> None:
        """Clients that batch read-lease releases (kvpool's does, on its next request) send them now,
        so our own finished read does not keep an object we are about to remove or replace alive."""
        flush = getattr(self.pool, "flush", None)
        if callable(flush):
            try:
                flush()
            except KVPoolError as exc:
                log.debug("pool flush failed: %s", exc)

    def _removed(self, key: str) -> None:
        if not key.startswith("tail/"):  # tails are request-scoped: never in the router's index
            self.emit("removed", [key])

    def fetch_prefix(self, token_ids: Sequence[int], max_tokens: int | None = None) -> list[ChunkView]:
        """Verified views of the longest cached prefix's chunks, in order (maybe empty)."""
        keys = self._capped_keys(token_ids, max_tokens)
        return self.reader.run(keys[:self.reader.match(keys)]) if keys else []

    def check_handle(self, handle: KVHandle) -> KVHandle:
        """Refuse a handle that is not of this namespace or does not name exactly its own prompt's
        keys: token ids are required, every chunk key is re-derived from them (our namespace, the
        tenant salt included), and the tail is `tail/<request_id>`. (A signature, with a keyring,
        is checked by the caller that knows the tenant: `KVHandle.verify`.)"""
        handle.validate()
        if handle.namespace != self.namespace_hex:
            raise LayoutMismatch(f"KV handle was written under namespace {handle.namespace}, "
                                 f"this adapter reads {self.namespace_hex} (other model, dtype, chunk size or tenant)")
        if handle.chunk_tokens != self.chunk_tokens:
            raise LayoutMismatch(f"KV handle uses {handle.chunk_tokens}-token chunks, adapter {self.chunk_tokens}")
        if handle.token_ids is None:
            raise InvalidArgument("KV handle carries no token ids: a loader re-derives the keys it names from them")
        if self.chunk_keys(handle.token_ids) != list(handle.chunk_keys):
            raise InvalidArgument("KV handle chunk keys do not match its token ids")
        if handle.tail_key is not None and (handle.request_id is None or handle.tail_key != tail_key(handle.request_id)):
            raise InvalidArgument("KV handle tail key is not its request's tail/<request id>")
        return handle

    def fetch_handle(self, handle: KVHandle, skip: int = 0) -> list[ChunkView]:
        """Verified views of every object a handle names (chunks, then the tail), but its first
        `skip` chunks (a caller's own cache holds them); all or nothing."""
        self.check_handle(handle)
        tail = [handle.tail_key] if handle.tail_key else []
        keys = list(handle.chunk_keys[skip:]) + tail
        tokens = [self.chunk_tokens] * (len(keys) - len(tail)) + [handle.tail_tokens] * len(tail)
        return self.reader.exact(keys, tokens)

    # -- writing ----------------------------------------------------------------------------

    def plan_save(self, token_ids: Sequence[int], *, request_id: str | None = None,
                  start_token: int = 0) -> tuple[list[str], list[PlannedObject], str | None]:
        """(all chunk keys, objects to write with fresh buffers, tail key) for a save.

        Full chunks from `start_token` on that the pool lacks (one exists_batch call), then the tail
        when `request_id` is given and the token count is not a multiple of chunk_tokens.
        """
        ids = check_token_ids(token_ids)
        c = self.chunk_tokens
        if not isinstance(start_token, int) or start_token < 0 or start_token % c or start_token > len(ids):
            raise InvalidArgument(f"start_token must be a multiple of {c} in 0..{len(ids)}, got {start_token!r}")
        keys = self.chunk_keys(ids)
        first = start_token // c
        candidates = keys[first:]
        present = self.pool.exists_batch(candidates) if candidates else []
        planned = [PlannedObject(key, (first + j) * c, c, False, bytearray(self.layout.object_nbytes(c)))
                   for j, (key, there) in enumerate(zip(candidates, present)) if not there]
        tail = None
        rest = len(ids) - len(keys) * c
        if request_id is not None:
            tail = tail_key(request_id) if rest else None
            if rest:
                planned.append(PlannedObject(tail, len(keys) * c, rest, True, bytearray(self.layout.object_nbytes(rest))))
        return keys, planned, tail

    def store(self, keys: list[str], planned: list[PlannedObject], tail: str | None, num_tokens: int) -> SaveResult:
        """Seal the planned buffers (payloads already filled) and put them in one batch.

        A full chunk the pool reports busy (`AlreadyExists`: another writer's put of the same
        content, or a removal still waiting for readers' leases) is retried for up to
        `BUSY_RETRY_S`, then left out of `stored_keys`: the cache is best effort, and a handle
        naming it reports the miss at load. Any other put error, and any error on the tail, is
        raised after the chunks that were stored are reported.
        """
        codec = self.reader.codec  # planned buffers hold the KV's own bytes; a codec encodes them here
        for obj in planned:
            if codec is None:
                seal_into(obj.buffer, self.layout, obj.tokens, key=obj.key, auth=self.auth)
            else:
                kv = payload_tensor(obj.buffer, self.layout, obj.tokens)
                obj.buffer = encode_chunk(self.layout, kv, obj.tokens, key=obj.key, auth=self.auth, codec=codec)
        if any(obj.is_tail for obj in planned):
            self._flush_releases()
            for obj in planned:
                if obj.is_tail:  # a put never overwrites (first writer wins): a re-run request replaces its tail
                    self.pool.remove(obj.key)
        errors = self.pool.put_batch([(obj.key, obj.buffer) for obj in planned]) if planned else []
        deadline = time.monotonic() + BUSY_RETRY_S
        while True:
            busy = [j for j, (obj, err) in enumerate(zip(planned, errors))
                    if isinstance(err, AlreadyExists) and not obj.is_tail]
            if not busy or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
            retried = self.pool.put_batch([(planned[j].key, planned[j].buffer) for j in busy])
            for j, err in zip(busy, retried):
                errors[j] = err
        stored = [obj.key for obj, err in zip(planned, errors) if err is None and not obj.is_tail]
        if stored:
            self.emit("stored", stored)
        for obj, err in zip(planned, errors):
            if err is None:
                continue
            if isinstance(err, AlreadyExists) and not obj.is_tail:
                log.warning("save: chunk %s is busy in the pool (%s); not stored this time", obj.key, err)
                continue
            log.warning("save: put %s failed: %s", obj.key, err)
            raise err if isinstance(err, KVPoolError) else KVPoolError(f"put {obj.key} failed: {err}")
        return SaveResult(keys=keys, tail_key=tail, stored_chunks=len(stored), stored_keys=stored, num_tokens=num_tokens)

    def make_handle(self, token_ids: Sequence[int], saved: SaveResult, request_id: str | None = None) -> KVHandle:
        ids = check_token_ids(token_ids)
        if saved.keys != self.chunk_keys(ids):
            raise InvalidArgument("save result does not belong to these token ids")
        if len(ids) % self.chunk_tokens and saved.tail_key is None:
            raise InvalidArgument("the token ids end in a partial chunk: save with a request_id to store its tail")
        rid = request_id or (saved.tail_key[len("tail/"):] if saved.tail_key else None)
        return KVHandle(namespace=self.namespace_hex, request_id=rid, num_tokens=len(ids),
                        chunk_tokens=self.chunk_tokens, chunk_keys=list(saved.keys),
                        tail_key=saved.tail_key if len(ids) % self.chunk_tokens else None,
                        token_ids=ids).validate()

    def release_handle(self, handle: KVHandle, *, verified: bool = False) -> bool:
        """Remove the handle's tail (chunks stay: they are shared, content-addressed cache); True
        when removed. Unless the caller has just read it through this store's reader (`verified`),
        the tail is read first and removed only if it verifies as this store's object under that
        key (its namespace, and with a MAC key its MAC): a handle naming another tenant's tail
        (request-scoped keys are not namespaced) removes nothing."""
        self.check_handle(handle)
        if not handle.tail_key:
            return False
        if not verified:
            blob = self.pool.get(handle.tail_key)
            if blob is None:
                return False
            try:
                decode_chunk(blob, self.layout, key=handle.tail_key, auth=self.auth, codec=self.reader.codec)
            except (CorruptObject, LayoutMismatch) as exc:
                log.warning("not releasing %s: it is not this namespace's object (%s)", handle.tail_key, exc)
                return False
            del blob
            self._flush_releases()  # our read's lease would defer the removal
        return bool(self.pool.remove(handle.tail_key))

    def remove(self, keys: Sequence[str]) -> list[bool]:
        """Remove chunk objects (e.g. an operator evicting a prefix) and report them."""
        keys = list(keys)
        done = self.pool.remove_batch(keys) if keys else []
        gone = [k for k, ok in zip(keys, done) if ok]
        if gone:
            self.emit("removed", gone)
        return done

    # -- events -----------------------------------------------------------------------------

    def add_listener(self, callback: Callable[[KVEvent], None]) -> None:
        with self._lock:
            self._listeners.append(callback)

    def remove_listener(self, callback: Callable[[KVEvent], None]) -> None:
        with self._lock:
            if callback in self._listeners:
                self._listeners.remove(callback)

    def emit(self, kind: Literal["stored", "removed"], keys: list[str]) -> None:
        event = KVEvent(kind=kind, keys=list(keys), namespace=self.namespace_hex)
        with self._lock:
            listeners = list(self._listeners)
        for callback in listeners:
            try:
                callback(event)
            except Exception:  # a listener's bug must not fail a save or a load
                log.exception("KV event listener %r failed", callback)

