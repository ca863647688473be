"""The adapter contract between an inference engine and the pool, and its engine-free half.

An adapter moves one engine's KV cache to and from the pool as chunk objects
(`kvpool.layout`): full chunks of `chunk_tokens` tokens under content-addressed keys
(`kvpool.keys` chain from the namespace), the partial last chunk of a prompt as a
request-scoped object `tail/<request id>`. It never hands the engine KV it could not verify.

Usage (the HuggingFace adapter; every adapter has the same methods, `kv` in its engine's format):

    from engine_adapters.model import load_reference_model
    from engine_adapters.hf import HFAdapter
    rm = load_reference_model()                       # float32 CPU; dtype="bfloat16" also works
    ad = HFAdapter(pool, rm.model, rm.namespace(chunk_tokens=256, tenant_salt=""))
    n = ad.lookup(ids)                                # cached prefix in tokens, one match_prefix
    res = ad.load(ids, max_tokens=len(ids) - 1)       # LoadResult(num_tokens, cache)
    ... compute ids[res.num_tokens:] on top of res.cache ...
    saved = ad.save(ids, cache, request_id="r1", start_token=res.num_tokens)
    handle = ad.make_handle(ids, saved)               # KVHandle (JSON via handle.to_json())
    cache = ad.load_handle(handle)                    # on the decode side: bit-exact KV of ids
    ad.release_handle(handle)                         # drops the tail object
    ad.add_listener(lambda ev: ...)                   # KVEvent(kind="stored"|"removed", keys, namespace)

Layer-wise forms, so transfer overlaps compute:

    ld = ad.start_load(ids, max_tokens=None)          # fetches in a background thread
    k, v = ld.wait_layer(i)                           # KV of layer i for the loaded prefix
    res = ld.wait()                                   # LoadResult, as `load` returns
    sv = ad.start_save(ids, request_id="r1", start_token=0)
    sv.save_layer(i, k, v)                            # copy layer i as soon as it is computed
    saved = sv.finish()                               # seal and put: SaveResult, as `save` returns
    # HF only: run the model straight on the arriving prefix, saving each layer as it is computed
    cache = sv.attach(ld.cache()); logits, cache = forward(rm.model, ids, cache); sv.finish()

What layer-wise buys with whole-object gets (`PoolClient`): a layer of the prefix is complete
only when every chunk has arrived (each chunk object holds all layers), so `start_load` overlaps
the scatter of later layers (and, on a GPU, their host-to-device copy) with the compute of
earlier ones; `start_save` copies each layer out as it is computed, so after the forward pass
only sealing and the puts remain. A transport that streams the layer-major payload could signal
layer i sooner without changing this contract.

Invariants every adapter keeps (tests/engine_adapters/conformance.py checks them):
- `load` returns the longest prefix whose chunks all arrive and verify (layout hash and checksum);
  a chunk that fails is removed from the pool (so the next save re-stores it), reported as a
  "removed" event, and the prefix stops before it: a shorter prefix, never wrong KV.
- `load_handle` is all or nothing: any missing or damaged object raises `KeyNotFound` or
  `CorruptObject` (the decode side then recomputes); a handle of another namespace raises
  `LayoutMismatch`.
- `save` writes only full chunks not already present, from `start_token` on (chunks before it are
  the caller's loaded prefix), and the tail only when a request id is given (replacing any older
  tail of that request id). It emits one "stored" event listing exactly the chunk keys it wrote
  (tails are request-scoped and never reported).
- KV of another model, weight file, dtype, chunk size or tenant salt is never loaded: it lives
  under other keys, and handles carry their namespace.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol, Sequence, runtime_checkable

import msgspec
import numpy as np

from kvpool.handle import KVHandle
from kvpool.api import PoolClient
from kvpool.errors import (AlreadyExists, CorruptObject, InvalidArgument, KeyNotFound, KVPoolError,
                           LayoutMismatch)
from kvpool.keys import Namespace, chunk_keys_hex, tail_key
from kvpool.layout import ChunkView, KVLayout, decode_chunk, seal_into

log = logging.getLogger(__name__)

EVENT_VERSION = 1
BUSY_RETRY_S = 1.0  # how long a save retries a chunk the pool reports busy (AlreadyExists)


class KVEvent(msgspec.Struct, frozen=True, kw_only=True):
    """A change to what the pool holds for one namespace, for the router's prefix index."""

    version: int = EVENT_VERSION
    kind: Literal["stored", "removed"]
    keys: list[str]
    namespace: str  # Namespace.hex()


@dataclass
class LoadResult:
    """`num_tokens` tokens of KV (a multiple of chunk_tokens) in the engine's format; cache is None
    when nothing was loaded."""

    num_tokens: int
    cache: Any = None


@dataclass
class SaveResult:
    keys: list[str]  # chunk keys of every full chunk of the token ids (stored now or before)
    tail_key: str | None  # tail/<request id>, or None (no request id, or no partial chunk)
    stored_chunks: int = 0  # how many chunk objects this call wrote
    stored_keys: list[str] = field(default_factory=list)
    num_tokens: int = 0


@runtime_checkable
class LayerwiseLoad(Protocol):
    def num_tokens(self) -> int:
        """Tokens being loaded; blocks until the chunks are fetched and verified."""
        ...

    def wait_layer(self, i: int) -> tuple[Any, Any]:
        """K and V of layer `i` for the whole loaded prefix (blocks until they are in place)."""
        ...

    def wait(self) -> LoadResult: ...


@runtime_checkable
class LayerwiseSave(Protocol):
    def save_layer(self, i: int, k: Any, v: Any) -> None:
        """Hand over layer `i`'s K and V covering tokens 0..len(token_ids) (engine format)."""
        ...

    def finish(self) -> SaveResult:
        """Seal and put every planned object; every layer must have been saved."""
        ...


@runtime_checkable
class EngineAdapter(Protocol):
    """What the reference workers (and a real engine's connector) call. See the module docstring."""

    namespace: Namespace
    layout: KVLayout

    def chunk_keys(self, token_ids: Sequence[int]) -> list[str]: ...

    def lookup(self, token_ids: Sequence[int], max_tokens: int | None = None) -> int: ...

    def load(self, token_ids: Sequence[int], max_tokens: int | None = None) -> LoadResult: ...

    def save(self, token_ids: Sequence[int], kv: Any, *, request_id: str | None = None,
             start_token: int = 0) -> SaveResult: ...

    def start_load(self, token_ids: Sequence[int], max_tokens: int | None = None) -> LayerwiseLoad: ...

    def start_save(self, token_ids: Sequence[int], *, request_id: str | None = None,
                   start_token: int = 0) -> LayerwiseSave: ...

    def make_handle(self, token_ids: Sequence[int], saved: SaveResult) -> KVHandle: ...

    def load_handle(self, handle: KVHandle) -> Any: ...

    def release_handle(self, handle: KVHandle) -> None: ...

    def add_listener(self, callback: Callable[[KVEvent], None]) -> None: ...

    def remove_listener(self, callback: Callable[[KVEvent], None]) -> None: ...


@dataclass
class PlannedObject:
    """One chunk object a save will write: tokens [start, start + tokens) under `key`."""

    key: str
    start: int
    tokens: int
    is_tail: bool
    buffer: bytearray


def _check_token_ids(token_ids: Sequence[int]) -> list[int]:
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
    """The engine-free half of an adapter: keys, pool calls, verification, events.

    An adapter owns one and only converts between its engine's KV and `ChunkView`s / payload
    buffers. Thread-safe for concurrent requests (the pool client is; listeners are called from the
    thread that made the change, outside any lock).
    """

    def __init__(self, pool: PoolClient, namespace: Namespace):
        self.pool = pool
        self.namespace = namespace
        self.layout = namespace.layout
        self._ns_digest = namespace.digest()
        self.namespace_hex = self._ns_digest.hex()
        self._listeners: list[Callable[[KVEvent], None]] = []
        self._lock = threading.Lock()

    # -- keys and lookups -------------------------------------------------------------------

    @property
    def chunk_tokens(self) -> int:
        return self.layout.chunk_tokens

    def chunk_keys(self, token_ids: Sequence[int]) -> list[str]:
        return chunk_keys_hex(self._ns_digest, _check_token_ids(token_ids), self.chunk_tokens)

    def _capped_keys(self, token_ids: Sequence[int], max_tokens: int | None) -> list[str]:
        ids = _check_token_ids(token_ids)
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

    def _discard(self, key: str, why: Exception) -> None:
        """A stored object failed verification: drop it so a later save can store a good copy."""
        log.warning("chunk %s failed verification (%s); removing it and treating it as a miss", key, why)
        self._flush_releases()
        try:
            removed = self.pool.remove(key)
        except KVPoolError as exc:
            log.warning("could not remove damaged chunk %s: %s", key, exc)
            return
        if removed and not key.startswith("tail/"):
            self.emit("removed", [key])

    def _get_many(self, keys: list[str]) -> list[bytes | None]:
        """get_batch, then a single get for each miss up to the first key still missing (callers stop
        there): a pool may refuse a batch larger than it can pin at once (SSD objects promoted
        through a small DRAM tier) yet serve the same objects one by one."""
        out = self.pool.get_batch(keys) if keys else []
        for j, data in enumerate(out):
            if data is None:
                out[j] = self.pool.get(keys[j])
                if out[j] is None:
                    break
        return out

    def fetch_prefix(self, token_ids: Sequence[int], max_tokens: int | None = None) -> list[ChunkView]:
        """Verified views of the longest cached prefix's chunks, in order (maybe empty)."""
        keys = self._capped_keys(token_ids, max_tokens)
        if not keys:
            return []
        n = self.pool.match_prefix(keys)
        if n == 0:
            return []
        views: list[ChunkView] = []
        for key, data in zip(keys[:n], self._get_many(keys[:n])):
            if data is None:  # evicted since match_prefix: the prefix ends here
                break
            try:
                view = decode_chunk(data, self.layout)
                if view.tokens != self.chunk_tokens:
                    raise CorruptObject(f"full chunk holds {view.tokens} tokens, expected {self.chunk_tokens}")
            except (CorruptObject, LayoutMismatch) as exc:
                self._discard(key, exc)
                break
            views.append(view)
        return views

    def check_handle(self, handle: KVHandle) -> KVHandle:
        handle.validate()
        if handle.namespace != self.namespace_hex:
            raise LayoutMismatch(f"KV handle was written under namespace {handle.namespace}, "
                                 f"this adapter reads {self.namespace_hex} (other model, dtype, chunk size or tenant)")
        if handle.chunk_tokens != self.chunk_tokens:
            raise LayoutMismatch(f"KV handle uses {handle.chunk_tokens}-token chunks, adapter {self.chunk_tokens}")
        if handle.token_ids is not None and self.chunk_keys(handle.token_ids) != list(handle.chunk_keys):
            raise InvalidArgument("KV handle chunk keys do not match its token ids")
        return handle

    def fetch_handle(self, handle: KVHandle) -> list[ChunkView]:
        """Verified views of every object a handle names (chunks, then the tail); all or nothing."""
        self.check_handle(handle)
        keys = list(handle.chunk_keys) + ([handle.tail_key] if handle.tail_key else [])
        views: list[ChunkView] = []
        for i, (key, data) in enumerate(zip(keys, self._get_many(keys))):
            if data is None:
                raise KeyNotFound(f"KV handle object {key} is not in the pool")
            expected = self.chunk_tokens if i < len(handle.chunk_keys) else handle.tail_tokens
            try:
                view = decode_chunk(data, self.layout)
            except LayoutMismatch as exc:
                self._discard(key, exc)
                raise CorruptObject(f"KV handle object {key}: {exc}") from None
            except CorruptObject:
                self._discard(key, CorruptObject("checksum/format"))
                raise
            if view.tokens != expected:
                raise CorruptObject(f"KV handle object {key} holds {view.tokens} tokens, expected {expected}")
            views.append(view)
        return views

    # -- writing ----------------------------------------------------------------------------

    def plan_save(self, token_ids: Sequence[int], *, request_id: str | None = None,
                  start_token: int = 0) -> tuple[list[str], list[PlannedObject], str | None]:
        """(all chunk keys, objects to write with fresh buffers, tail key) for a save.

        Full chunks from `start_token` on that the pool lacks (one exists_batch call), then the tail
        when `request_id` is given and the token count is not a multiple of chunk_tokens.
        """
        ids = _check_token_ids(token_ids)
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
        for obj in planned:
            seal_into(obj.buffer, self.layout, obj.tokens)
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
        ids = _check_token_ids(token_ids)
        if saved.keys != self.chunk_keys(ids):
            raise InvalidArgument("save result does not belong to these token ids")
        if len(ids) % self.chunk_tokens and saved.tail_key is None:
            raise InvalidArgument("the token ids end in a partial chunk: save with a request_id to store its tail")
        rid = request_id or (saved.tail_key[len("tail/"):] if saved.tail_key else None)
        return KVHandle(namespace=self.namespace_hex, request_id=rid, num_tokens=len(ids),
                        chunk_tokens=self.chunk_tokens, chunk_keys=list(saved.keys),
                        tail_key=saved.tail_key if len(ids) % self.chunk_tokens else None,
                        token_ids=ids).validate()

    def release_handle(self, handle: KVHandle) -> None:
        """Remove the handle's tail (chunks stay: they are shared, content-addressed cache)."""
        self.check_handle(handle)
        if handle.tail_key:
            self.pool.remove(handle.tail_key)

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


class ChunkStoreAdapter:
    """The contract methods an adapter answers from its `ChunkStore` alone (no engine format);
    an adapter sets `self.store` and adds `load`, `save`, `load_handle` and the layer-wise forms."""

    store: ChunkStore

    def chunk_keys(self, token_ids: Sequence[int]) -> list[str]:
        return self.store.chunk_keys(token_ids)

    def lookup(self, token_ids: Sequence[int], max_tokens: int | None = None) -> int:
        return self.store.lookup(token_ids, max_tokens)

    def make_handle(self, token_ids: Sequence[int], saved: SaveResult) -> KVHandle:
        return self.store.make_handle(token_ids, saved)

    def release_handle(self, handle: KVHandle) -> None:
        self.store.release_handle(handle)

    def remove(self, keys: Sequence[str]) -> list[bool]:
        return self.store.remove(keys)

    def add_listener(self, callback: Callable[[KVEvent], None]) -> None:
        self.store.add_listener(callback)

    def remove_listener(self, callback: Callable[[KVEvent], None]) -> None:
        self.store.remove_listener(callback)


class BackgroundLayerwiseLoad:
    """The engine-free half of a `LayerwiseLoad`: fetches and verifies the prefix in a background
    thread, then has the subclass place it layer by layer; `wait_layer(i)` returns as soon as layer
    i is in place, and every waiter re-raises an error of the thread.

    A subclass sets its own fields, then calls `__init__` (which starts the thread), and implements
    `_prepare(views)` (allocate the target for the non-empty prefix; returns the token count to
    report), `_fill_layer(i, views)`, `_layer(i)` (K and V of a placed layer) and `_result()` (the
    engine-format KV for `wait`)."""

    def __init__(self, store: ChunkStore, token_ids: Sequence[int], max_tokens: int | None, *, thread_name: str):
        self._store = store
        self._fetched = threading.Event()
        self._ready = [threading.Event() for _ in range(store.layout.num_layers)]
        self._error: BaseException | None = None
        self._loaded = False
        self._num_tokens = 0
        self._thread = threading.Thread(target=self._run, args=(list(token_ids), max_tokens), daemon=True,
                                        name=thread_name)
        self._thread.start()

    def _prepare(self, views: list[ChunkView]) -> int:
        raise NotImplementedError

    def _fill_layer(self, i: int, views: list[ChunkView]) -> None:
        raise NotImplementedError

    def _layer(self, i: int) -> tuple[Any, Any]:
        raise NotImplementedError

    def _result(self) -> Any:
        raise NotImplementedError

    def _run(self, ids: list[int], max_tokens: int | None) -> None:
        try:
            views = self._store.fetch_prefix(ids, max_tokens)
            if views:
                self._num_tokens = self._prepare(views)
                self._loaded = True
            self._fetched.set()
            for i, ready in enumerate(self._ready):
                if self._loaded:
                    self._fill_layer(i, views)
                ready.set()
        except BaseException as exc:  # handed to the waiting thread, which re-raises it
            self._error = exc
            self._fetched.set()
            for ready in self._ready:
                ready.set()

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def num_tokens(self) -> int:
        self._fetched.wait()
        self._check()
        return self._num_tokens

    def wait_layer(self, i: int) -> tuple[Any, Any]:
        if not 0 <= i < len(self._ready):
            raise InvalidArgument(f"layer {i} out of range 0..{len(self._ready) - 1}")
        self._ready[i].wait()
        self._check()
        if not self._loaded:
            raise InvalidArgument("nothing was loaded (num_tokens() == 0): there is no layer KV to wait for")
        return self._layer(i)

    def wait(self) -> LoadResult:
        self._thread.join()
        self._check()
        return LoadResult(self._num_tokens, self._result()) if self._loaded else LoadResult(0, None)


class PlannedLayerwiseSave:
    """The engine-free half of a `LayerwiseSave`: planned at construction (one exists_batch), so
    only missing chunks are copied; `finish` seals and puts them once every layer was handed over.

    A subclass sets its own fields, then calls `__init__`, and implements `_payload(obj)` (the
    writable engine view of a planned object's payload) and `_copy_layer(i, k, v)` (check layer
    i's K and V and copy them into `self._payloads`)."""

    def __init__(self, store: ChunkStore, token_ids: Sequence[int], request_id: str | None, start_token: int):
        self._store = store
        self.num_tokens = len(token_ids)
        self.keys, self.planned, self.tail = store.plan_save(token_ids, request_id=request_id,
                                                             start_token=start_token)
        self._payloads = [self._payload(obj) for obj in self.planned]
        self._done = [False] * store.layout.num_layers
        self._finished = False

    def _payload(self, obj: PlannedObject) -> Any:
        raise NotImplementedError

    def _copy_layer(self, i: int, k: Any, v: Any) -> None:
        raise NotImplementedError

    def save_layer(self, i: int, k: Any, v: Any) -> None:
        if not 0 <= i < len(self._done):
            raise InvalidArgument(f"layer {i} out of range 0..{len(self._done) - 1}")
        self._copy_layer(i, k, v)
        self._done[i] = True

    def finish(self) -> SaveResult:
        if self._finished:
            raise InvalidArgument("this save has already finished")
        missing = [i for i, done in enumerate(self._done) if not done]
        if missing and self.planned:
            raise InvalidArgument(f"layers {missing[:5]}{'...' if len(missing) > 5 else ''} were never saved")
        self._finished = True
        return self._store.store(self.keys, self.planned, self.tail, self.num_tokens)
