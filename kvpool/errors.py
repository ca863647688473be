"""One error hierarchy for everything in `kvpool` (and, by mapping, `engine_adapters`).

HTTP layers map these to status codes with `http_status`; the SDK re-raises the same classes
from wire errors, so a caller catches `KeyNotFound` whether the store is in-process or remote.
`transfer/` has its own errors (it imports nothing from here); `kvpool` wraps them.
"""

from __future__ import annotations


_BY_CODE: dict[str, type[KVPoolError]] = {}


class KVPoolError(Exception):
    """Base of every error kvpool raises on purpose. A subclass names its wire `code` and its
    `http_status` in its class line (`class X(KVPoolError, code="x", http_status=409)`); one that
    names a code is what `error_from_code` rebuilds for it."""

    code = "internal"
    http_status = 500

    def __init_subclass__(cls, code: str | None = None, http_status: int | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if http_status is not None:
            cls.http_status = http_status
        if code is not None:
            cls.code = code
            _BY_CODE.setdefault(code, cls)


class InvalidArgument(KVPoolError, ValueError, code="invalid_argument", http_status=400):
    """The caller passed something malformed: a bad key, a wrong type, a negative size."""


class ObjectTooLarge(InvalidArgument, code="object_too_large", http_status=413):
    """The value is larger than the tier, node or protocol can ever hold."""


class KeyNotFound(KVPoolError, KeyError, code="not_found", http_status=404):
    """The key is not present (or not complete) anywhere the caller asked."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep messages readable
        return str(self.args[0]) if self.args else "key not found"


class AlreadyExists(KVPoolError, code="already_exists", http_status=409):
    """A put for a key that is already complete (or being written) with other content."""


class CapacityError(KVPoolError, code="capacity", http_status=507):
    """No room: the tier or pool is full and nothing can be evicted."""


class AllPinned(CapacityError, code="all_pinned"):
    """No room, and every candidate for eviction is pinned by a lease."""


class CorruptObject(KVPoolError, code="corrupt", http_status=500):
    """Bytes that do not decode as a chunk object. Readers treat this as a miss."""


class FormatError(CorruptObject, code="format"):
    """Wrong magic, unknown version or truncated header."""


class ChecksumMismatch(CorruptObject, code="checksum"):
    """The payload checksum does not match the header: the object is damaged."""


class UntrustedChunk(CorruptObject, code="untrusted_chunk"):
    """A chunk that does not prove it belongs where it was read: another namespace or key in its
    header, or a MAC that does not verify under the reader's tenant key. A miss; never removed by
    a reader (it is not provably the reader's own object)."""


class LayoutMismatch(KVPoolError, code="layout_mismatch", http_status=409):
    """The chunk was written for another KV layout (model, dtype, chunk size...)."""


class NotLeader(KVPoolError, code="not_leader", http_status=503):
    """This master is a standby; the caller should retry against the leader."""


class Unavailable(KVPoolError, code="unavailable", http_status=503):
    """A service or node could not be reached, or did not answer in time."""


class Unauthorized(KVPoolError, code="unauthorized", http_status=401):
    """Missing or wrong credentials (bearer token, keyring secret): who is asking is unknown."""


class Forbidden(KVPoolError, code="forbidden", http_status=403):
    """The caller is known, but its role may not do this (a tenant calling a node-only message)."""


class QuotaExceeded(CapacityError, code="quota_exceeded", http_status=429):
    """The caller's tenant is at its byte or key quota; its own evictions or removes make room."""


class LimitExceeded(KVPoolError, code="limit_exceeded", http_status=429):
    """A per-connection or per-server limit (size, rate, count, time) was hit; the setting is named."""


def error_from_code(code: str, message: str) -> KVPoolError:
    """Rebuild a typed error from its wire form (code, message)."""
    return _BY_CODE.get(code, KVPoolError)(message)
