"""`AsyncClient`: the asyncio face of the SDK.

Each call runs a synchronous `Client` method on a small thread pool, one `Client` (with its own
connections) per worker thread, so N concurrent awaits use up to N connections in parallel and
the event loop never blocks on a socket. The byte paths are the sync client's (shm / recv_into).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from kvpool.client.sync import Client


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

    async def put(self, key: str, value: Any, *, replicas: int | None = None) -> None:
        await self._run(lambda c: c.put(key, value, replicas=replicas))

    async def put_from(self, key: str, buffer: Any, *, replicas: int | None = None) -> None:
        await self._run(lambda c: c.put_from(key, buffer, replicas=replicas))

    async def get(self, key: str) -> bytes | None:
        return await self._run(lambda c: c.get(key))

    async def get_into(self, key: str, buffer: Any) -> int:
        return await self._run(lambda c: c.get_into(key, buffer))

    async def exists(self, key: str) -> bool:
        return await self._run(lambda c: c.exists(key))

    async def remove(self, key: str) -> bool:
        return await self._run(lambda c: c.remove(key))

    async def match_prefix(self, keys: Sequence[str]) -> int:
        return await self._run(lambda c: c.match_prefix(keys))

    async def put_batch(self, items: Sequence[tuple[str, Any]], *,
                        replicas: int | None = None) -> list[Exception | None]:
        return await self._run(lambda c: c.put_batch(items, replicas=replicas))

    async def get_batch(self, keys: Sequence[str], *, tiers: list[str] | None = None) -> list[bytes | None]:
        return await self._run(lambda c: c.get_batch(keys, tiers=tiers))

    async def get_batch_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        return await self._run(lambda c: c.get_batch_into(keys, buffers))

    async def exists_batch(self, keys: Sequence[str]) -> list[bool]:
        return await self._run(lambda c: c.exists_batch(keys))

    async def remove_batch(self, keys: Sequence[str]) -> list[bool]:
        return await self._run(lambda c: c.remove_batch(keys))

    async def admin(self, method: str, **args: Any) -> Any:
        """A master admin method by name (nodes, node, stats, key_info, keys, config)."""
        return await self._run(lambda c: c.admin(method, **args))

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
