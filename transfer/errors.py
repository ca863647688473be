"""Errors of the transfer layer. `transfer` imports nothing from `kvpool`; the pool wraps these.

Every failure an op can meet is a `TransferError`; a batch that fails carries the per-op
causes in `failures` (op index -> exception), so a caller can retry only what failed.
"""

from __future__ import annotations


class TransferError(Exception):
    """Base of every error the transfer engine raises on purpose.

    `failures` maps op index -> the exception that op met (empty for errors that are not about
    a batch, e.g. a bad registration).
    """

    def __init__(self, message: str = "", failures: dict[int, BaseException] | None = None):
        super().__init__(message)
        self.failures: dict[int, BaseException] = dict(failures or {})


class TransferTimeout(TransferError, TimeoutError):
    """The peer did not answer within the engine's timeout, or `wait(timeout)` ran out."""


class InvalidOp(TransferError, ValueError):
    """An op or registration is malformed: out-of-range offsets, read-only buffer, bad opcode.

    Raised by `submit` before any byte of the batch moves.
    """


class SegmentNotFound(TransferError, KeyError):
    """The remote engine has no registered segment of that name (never was, or unregistered)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "segment not found"


class PeerUnavailable(TransferError, ConnectionError):
    """The peer could not be reached, closed the connection, or its process is gone."""


class ProtocolError(TransferError):
    """A frame on the wire is malformed: bad magic, unknown version or opcode, truncated."""


class TransportUnavailable(TransferError):
    """The requested transport is not offered by both sides (or not usable on this machine)."""


class AccessDenied(TransferError, PermissionError):
    """The peer refused: this connection did not authenticate, or the op has no valid grant
    (none, forged, expired, or for another op or range). Nothing moved."""


class LimitReached(TransferError):
    """The peer refused the connection at one of its limits (connections per server or per peer)."""
