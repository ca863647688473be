"""The engine-free halves of the layer-wise forms (`LayerwiseLoad`, `LayerwiseSave` in
`engine_adapters.base`): an adapter subclasses them and supplies only the engine-format steps.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

from engine_adapters.base import LoadResult, SaveResult
from engine_adapters.chunk_store import ChunkStore, PlannedObject
from kvpool.chunk_format import ChunkView
from kvpool.errors import InvalidArgument


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
