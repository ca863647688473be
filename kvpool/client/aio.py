"""`AsyncClient`: the asyncio face of the SDK.

Each call runs a synchronous `Client` method on a small thread pool, one `Client` (with its own
connections) per worker thread, so N concurrent awaits use up to N connections in parallel and
the event loop never blocks on a socket. The byte paths are the sync client's (shm / recv_into).
"""

from __future__ import annotations

import asyncio
import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable, Concatenate, ParamSpec, TypeVar

from kvpool.client.sync import Client

P = ParamSpec("P")
R = TypeVar("R")


def _in_thread(method: Callable[Concatenate[Client, P], R]
               ) -> Callable[Concatenate["AsyncClient", P], Awaitable[R]]:
    """The async form of a `Client` method, with its signature and docstring: run on the pool."""

    async def call(self: "AsyncClient", *args: P.args, **kwargs: P.kwargs) -> R:
        return await self._run(lambda client: method(client, *args, **kwargs))

    return functools.wraps(method)(call)


class AsyncClient:
    def __init__(self, address: str | None = None, *, concurrency: int = 4, **client_kwargs: Any):
        from kvpool.config import current_settings

        self.address = address or current_settings().pool.master
        self._kwargs = client_kwargs
        self._local = threading.local()
        self._clients: list[Client] = []
        self._clients_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="kvpool-aio")

    def _client(self) -> Client:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = Client(self.address, **self._kwargs)
            with self._clients_lock:
                self._clients.append(client)
        return client

    async def _run(self, fn: Callable[[Client], Any]) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(self._client()))

    async def connect(self) -> "AsyncClient":
        """Open one connection now, so a bad address fails here rather than on the first call."""
        await self._run(lambda c: None)
        return self

    put = _in_thread(Client.put)
    put_from = _in_thread(Client.put_from)
    get = _in_thread(Client.get)
    get_into = _in_thread(Client.get_into)
    exists = _in_thread(Client.exists)
    remove = _in_thread(Client.remove)
    match_prefix = _in_thread(Client.match_prefix)
    put_batch = _in_thread(Client.put_batch)
    get_batch = _in_thread(Client.get_batch)
    get_batch_into = _in_thread(Client.get_batch_into)
    exists_batch = _in_thread(Client.exists_batch)
    remove_batch = _in_thread(Client.remove_batch)
    admin = _in_thread(Client.admin)

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._close_sync)

    def _close_sync(self) -> None:
        self._pool.shutdown(wait=True)
        with self._clients_lock:
            clients, self._clients = self._clients, []
        for c in clients:
            c.close()

    async def __aenter__(self) -> "AsyncClient":
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
