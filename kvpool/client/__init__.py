"""The pool SDK: `connect(address)` -> `Client` (sync), `connect_async(address)` -> `AsyncClient`.

`address` is "host:port" of an embedded pool (`kvpool serve`) or a master, or "etcd://host:port"
in cluster mode (the client finds the leader master there and follows failovers).
"""

from __future__ import annotations

from typing import Any

from kvpool.client.aio import AsyncClient
from kvpool.client.sync import Client


def connect(address: str | None = None, **kwargs: Any) -> Client:
    """A connected synchronous client of the pool at `address` (default: `[pool] master` of the
    configuration, KVPOOL_MASTER, else 127.0.0.1:7600). kwargs: timeout, replicas, use_shm, writer_node, data_path
    ("auto" | "rpc" | "engine"), transfer_engine, transports, credential (a `kvpool.security.keyring.Credential`;
    default: `KVPOOL_PRINCIPAL` in the keyring file `KVPOOL_AUTH_FILE`, see `Client`)."""
    return Client(address, **kwargs)


async def connect_async(address: str | None = None, **kwargs: Any) -> AsyncClient:
    """A connected asyncio client. kwargs: concurrency, and the `Client` ones."""
    return await AsyncClient(address, **kwargs).connect()


__all__ = ["AsyncClient", "Client", "connect", "connect_async"]
