"""The adapter contract between an inference engine and the pool.

An adapter moves one engine's KV cache to and from the pool as chunk objects
(`kvpool.chunk_format`): full chunks of `chunk_tokens` tokens under content-addressed keys
(`kvpool.keys` chain from the namespace), the partial last chunk of a prompt as a
request-scoped object `tail/<request id>`. It never hands the engine KV it could not verify.

Usage (the HuggingFace adapter; every adapter has the same methods, `kv` in its engine's format):

    from reference_worker.model import load_reference_model
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

Where the engine-free half lives: `chunk_store.ChunkStore` (keys, lookups, writes, handles,
events) and `chunk_reader.ChunkReader` (every verified read, by every adapter and worker).

Invariants every adapter keeps (tests/engine_adapters/conformance.py checks them):
- `load` returns the longest prefix whose chunks all arrive and verify (layout hash, checksum,
  token count); a chunk that fails is removed from the pool (so the next save re-stores it),
  reported as a "removed" event, and the prefix stops before it: a shorter prefix, never wrong KV
  (the one rule of `ChunkReader`).
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

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol, Sequence, runtime_checkable

import msgspec

from kvpool.chunk_format import KVLayout
from kvpool.handle import KVHandle
from kvpool.keys import Namespace

EVENT_VERSION = 1


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
