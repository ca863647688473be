"""How the router calls a reference worker on a request's path, and what a failure means.

`WorkerCalls` is a mixin of `Router` (service.py): it uses the router's `hop` (hop.py), `metrics`
and `workers`.

    _post(worker, path, msg)     the body of a 2xx answer (POST /v1/prefill)
    _stream(worker, path, msg)   the NDJSON `TokenEvent`s of /v1/decode or /v1/generate

A worker that cannot be reached, breaks off, or answers 5xx or 503 (draining) raises
`_BeforeFirst` when nothing was streamed yet, so the caller may try once elsewhere; the worker is
taken out of rotation when unreachable, marked draining on a 503. A 4xx is the request's own
fault: its `kvpool.errors` error is raised as is. After the first event, a failure raises
`Unavailable` (or the worker's error).
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

from kvpool import worker_api as wire
from kvpool.errors import Unavailable, error_from_code
from kvpool.router.hop import HopError
from kvpool.router.workers import DRAINING, UP, WorkerState


class WorkerCalls:
    async def _post(self, worker: WorkerState, path: str, msg: Any, headers: dict[str, str] = None) -> bytes:
        """The body of a 2xx answer; a worker that fails or answers 5xx/503 raises `_BeforeFirst`."""
        try:
            resp = await self.hop.request(worker.url, path, wire.encode(msg), headers)
            try:
                body = await resp.read()
            finally:
                resp.release()
        except HopError as exc:
            self._failed(worker, path, exc)
            raise _BeforeFirst(worker.name, Unavailable(f"worker {worker.name} failed: {exc}"))
        if resp.status >= 400:
            raise self._error_of(worker, path, resp.status, body)
        return body

    async def _stream(self, worker: WorkerState, path: str, msg: Any, headers: dict[str, str],
                      before_first: bool) -> AsyncIterator[wire.TokenEvent]:
        got_any = False
        resp = None
        try:
            resp = await self.hop.request(worker.url, path, wire.encode(msg), headers)
            if resp.status >= 400:
                raise self._error_of(worker, path, resp.status, await resp.read())
            async for line in resp.lines():  # NDJSON: one event per line
                if not line.strip():
                    continue
                event = wire.decode(line, wire.TokenEvent)
                if event.error is not None:
                    err = error_from_code(event.error.code, event.error.message)
                    if not got_any and before_first:
                        raise _BeforeFirst(worker.name, err)
                    raise err
                got_any = True
                if event.done:  # the body ends right after: read its end and pool the connection now
                    await resp.finish()
                    resp.release()
                    yield event
                    return
                yield event
        except HopError as exc:
            self._failed(worker, path, exc)
            err = Unavailable(f"worker {worker.name} failed mid-request: {exc}")
            if not got_any and before_first:
                raise _BeforeFirst(worker.name, err) from None
            raise err from None
        finally:
            if resp is not None:
                resp.release()  # closes the connection unless the stream was read to its end

    def _error_of(self, worker: WorkerState, path: str, status: int, body: bytes) -> Exception:
        try:
            doc = json.loads(body)
            err = error_from_code(doc["code"], doc["message"])
        except Exception:
            err = Unavailable(f"worker {worker.name} answered {status} to {path}")
        if status >= 500 or isinstance(err, Unavailable):  # down or draining: try elsewhere
            self.metrics.worker_failures.labels(stage=path.rsplit("/", 1)[-1]).inc()
            if status == 503 and worker.status == UP:  # a worker answers 503 only when leaving
                worker.status = DRAINING
            return _BeforeFirst(worker.name, err)
        return err

    def _failed(self, worker: WorkerState, path: str, exc: Exception) -> None:
        self.metrics.worker_failures.labels(stage=path.rsplit("/", 1)[-1]).inc()
        self.workers.mark_down(worker, f"{path}: {type(exc).__name__}: {exc}")


class _BeforeFirst(Exception):
    """A worker failed before this step streamed anything: the step may be retried elsewhere."""

    def __init__(self, worker: str, error: Exception):
        super().__init__(str(error))
        self.worker = worker
        self.error = error
