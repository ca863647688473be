"""One error hierarchy for everything in `kvpool` (and, by mapping, `engine_adapters`).

HTTP layers map these to status codes with `http_status`; the SDK re-raises the same classes
from wire errors, so a caller catches `KeyNotFound` whether the store is in-process or remote.
`transfer/` has its own errors (it imports nothing from here); `kvpool` wraps them.
"""

from __future__ import annotations


class KVPoolError(Exception):
    """Base of every error kvpool raises on purpose."""

    code = "internal"
    http_status = 500


class InvalidArgument(KVPoolError, ValueError):
    """The caller passed something malformed: a bad key, a wrong type, a negative size."""

    code = "invalid_argument"
    http_status = 400


class ObjectTooLarge(InvalidArgument):
    """The value is larger than the tier, node or protocol can ever hold."""

    code = "object_too_large"
    http_status = 413


class KeyNotFound(KVPoolError, KeyError):
    """The key is not present (or not complete) anywhere the caller asked."""

    code = "not_found"
    http_status = 404

    def __str__(self) -> str:  # KeyError quotes its argument; keep messages readable
        return str(self.args[0]) if self.args else "key not found"


class AlreadyExists(KVPoolError):
    """A put for a key that is already complete (or being written) with other content."""

    code = "already_exists"
    http_status = 409


class CapacityError(KVPoolError):
    """No room: the tier or pool is full and nothing can be evicted."""

    code = "capacity"
    http_status = 507


class AllPinned(CapacityError):
    """No room, and every candidate for eviction is pinned by a lease."""

    code = "all_pinned"


class CorruptObject(KVPoolError):
    """Bytes that do not decode as a chunk object. Readers treat this as a miss."""

    code = "corrupt"
    http_status = 500


class FormatError(CorruptObject):
    """Wrong magic, unknown version or truncated header."""

    code = "format"


class ChecksumMismatch(CorruptObject):
    """The payload checksum does not match the header: the object is damaged."""

    code = "checksum"


class UntrustedChunk(CorruptObject):
    """A chunk that does not prove it belongs where it was read: another namespace or key in its
    header, or a MAC that does not verify under the reader's tenant key. A miss; never removed by
    a reader (it is not provably the reader's own object)."""

    code = "untrusted_chunk"


class LayoutMismatch(KVPoolError):
    """The chunk was written for another KV layout (model, dtype, chunk size...)."""

    code = "layout_mismatch"
    http_status = 409


class NotLeader(KVPoolError):
    """This master is a standby; the caller should retry against the leader."""

    code = "not_leader"
    http_status = 503


class Unavailable(KVPoolError):
    """A service or node could not be reached, or did not answer in time."""

    code = "unavailable"
    http_status = 503


class Unauthorized(KVPoolError):
    """Missing or wrong credentials (bearer token, keyring secret): who is asking is unknown."""

    code = "unauthorized"
    http_status = 401


class Forbidden(KVPoolError):
    """The caller is known, but its role may not do this (a tenant calling a node-only message)."""

    code = "forbidden"
    http_status = 403


class QuotaExceeded(CapacityError):
    """The caller's tenant is at its byte or key quota; its own evictions or removes make room."""

    code = "quota_exceeded"
    http_status = 429


class LimitExceeded(KVPoolError):
    """A per-connection or per-server limit (size, rate, count, time) was hit; the setting is named."""

    code = "limit_exceeded"
    http_status = 429


_BY_CODE: dict[str, type[KVPoolError]] = {}


def _collect(cls: type[KVPoolError]) -> None:
    _BY_CODE.setdefault(cls.code, cls)
    for sub in cls.__subclasses__():
        _collect(sub)


_collect(KVPoolError)


def error_from_code(code: str, message: str) -> KVPoolError:
    """Rebuild a typed error from its wire form (code, message)."""
    return _BY_CODE.get(code, KVPoolError)(message)
