"""kvpool: a distributed KV-cache pool for LLM serving with prefill/decode disaggregation."""

from kvpool.errors import KeyNotFound, KVPoolError
from kvpool.keys import Namespace, chunk_keys, chunk_keys_hex
from kvpool.chunk_format import KVLayout, decode_chunk, encode_chunk

__version__ = "0.1.0"

__all__ = [
    "KVLayout",
    "KVPoolError",
    "KeyNotFound",
    "Namespace",
    "__version__",
    "chunk_keys",
    "chunk_keys_hex",
    "connect",
    "connect_async",
    "decode_chunk",
    "encode_chunk",
]


def connect(address: str | None = None, **kwargs):
    """A client of the pool at `address` (default `[pool] master`, KVPOOL_MASTER; see `kvpool.client.connect`)."""
    from kvpool.client import connect as _connect

    return _connect(address, **kwargs)


async def connect_async(address: str | None = None, **kwargs):
    """An asyncio client of the pool at `address` (see `kvpool.client.connect_async`)."""
    from kvpool.client import connect_async as _connect_async

    return await _connect_async(address, **kwargs)
