"""The client contract every way of reaching the pool satisfies (remote SDK, asyncio SDK,
in-process embedded client). Engine adapters depend on this Protocol, not on a class.

Keys are strings: a chunk key's 32 lowercase hex characters, `tail/<request id>`, or any UTF-8
string of 1..512 bytes. Values are bytes-like (bytes, bytearray, memoryview, numpy arrays,
CPU torch tensors through `put_from`).

Invariants:
- A get never returns bytes other than exactly those one complete put stored under that key.
  A key that is absent, still being written, or whose stored copy fails its check is a miss:
  `get` returns None, `get_into` raises `KeyNotFound`.
- `put` of a key that already holds a complete object is a no-op that returns normally
  (chunk keys are content-addressed; the first writer wins).
- `match_prefix(keys)` returns n such that keys[0..n) are all present and complete, and
  keys[n] is not (or n == len(keys)); it is one round trip for the whole list.
- Batch forms return one entry per input, in input order; one bad key never fails the others.
"""

from __future__ import annotations

import re
from typing import Any, Protocol, Sequence, runtime_checkable

MAX_KEY_BYTES = 512


@runtime_checkable
class PoolClient(Protocol):
    def put(self, key: str, value: Any, *, replicas: int | None = None) -> None: ...

    def get(self, key: str) -> bytes | None: ...

    def get_into(self, key: str, buffer: Any) -> int:
        """Copy the object into `buffer` (writable, large enough); return its size."""
        ...

    def put_from(self, key: str, buffer: Any, *, replicas: int | None = None) -> None: ...

    def exists(self, key: str) -> bool: ...

    def remove(self, key: str) -> bool: ...

    def match_prefix(self, keys: Sequence[str]) -> int: ...

    def put_batch(self, items: Sequence[tuple[str, Any]], *, replicas: int | None = None) -> list[Exception | None]: ...

    def get_batch(self, keys: Sequence[str]) -> list[bytes | None]: ...

    def get_batch_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        """Copy each object into its buffer; per key its size, or -1 for a miss."""
        ...

    def exists_batch(self, keys: Sequence[str]) -> list[bool]: ...

    def remove_batch(self, keys: Sequence[str]) -> list[bool]: ...

    def close(self) -> None: ...


def check_key(key: Any) -> str:
    """Validate a key: a non-empty str of at most 512 UTF-8 bytes with no NUL."""
    # Fast path (every put and get checks its key several times on the way): for an ASCII str,
    # len() is the UTF-8 length and isascii() is O(1).
    if type(key) is str and key.isascii() and 0 < len(key) <= MAX_KEY_BYTES and "\x00" not in key:
        return key
    from kvpool.errors import InvalidArgument

    if not isinstance(key, str):
        raise InvalidArgument(f"key must be a str, got {type(key).__name__}")
    n = len(key.encode("utf-8", "surrogatepass"))
    if not 0 < n <= MAX_KEY_BYTES:
        raise InvalidArgument(f"key must be 1..{MAX_KEY_BYTES} UTF-8 bytes, got {n}")
    if "\x00" in key:
        raise InvalidArgument("key must not contain NUL")
    return key


# A tenant's keys are stored as "<tenant id>\x00<key>" (the pool scopes them, `kvpool.security.authz`):
# a user key never contains NUL, so no key of one tenant (or of an unscoped client) can name
# another tenant's. The tenant id is at most 64 characters (`kvpool.security.keyring.parse_role`).
SCOPE_SEP = "\x00"
MAX_TENANT_BYTES = 64


def scope_prefix(tenant: str | None) -> str:
    """What a tenant's keys are stored under ("" for an unscoped principal)."""
    return tenant + SCOPE_SEP if tenant else ""


_SCOPED_ASCII = re.compile(r"[A-Za-z0-9._-]{1,%d}\x00[^\x00]{1,%d}" % (MAX_TENANT_BYTES, MAX_KEY_BYTES))


def check_stored_key(key: Any) -> str:
    """Validate a key as the pool stores it: a user key (`check_key`), or a tenant-scoped one,
    "<tenant>\\x00<user key>". For code behind the RPC boundary (master, node, tiers)."""
    if type(key) is str and key.isascii():  # fast paths: each put and get checks its key several times
        if 0 < len(key) <= MAX_KEY_BYTES and SCOPE_SEP not in key:
            return key
        if _SCOPED_ASCII.fullmatch(key):
            return key
    if isinstance(key, str) and SCOPE_SEP in key:
        tenant, _, rest = key.partition(SCOPE_SEP)
        if 0 < len(tenant) <= MAX_TENANT_BYTES and tenant.isascii() and all(c.isalnum() or c in "-_." for c in tenant):
            check_key(rest)
            return key
    return check_key(key)
