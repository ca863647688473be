"""The TCP data protocol: fixed-size little-endian frame headers, then raw bytes.

Request  (36 bytes): magic u32 | version u8 | opcode u8 | flags u16 | seg_id u32 | req_id u64 | offset u64 | length u64
         then, with FLAG_GRANT, a 48-byte grant (`transfer.grant`) covering the op's range, then
         `length` payload bytes for WRITE (or a msgpack control message for CONTROL).
         `seg_id` is the number the owner gave the segment at registration (in its descriptor);
         ids are never reused within an engine's life, so a stale descriptor cannot reach a
         different buffer that was later registered under the same name.
Response (24 bytes): magic u32 | version u8 | status u8 | 0 u16 | req_id u64 | length u64
         then `length` bytes: the payload of an OK READ, a UTF-8 message for an error, or a
         msgpack control reply. A response with req_id 0 and an error status refuses the whole
         connection (no authentication, a connection cap): the server closes it after.

A server with a keyring (`DataServer(auth=...)`) first runs `transfer.auth`'s handshake (channel
"transfer") on each connection; one that requires grants serves a READ/WRITE only when its grant
is valid and covers it (E_FORBIDDEN otherwise; a refused WRITE's payload is drained, never written).

Headers are `struct` layouts, not msgspec, because they sit on the hot path (one
`pack_into` into a reused buffer per slice); the control messages that set connections up
are versioned msgspec Structs. A server answers requests on one connection in order, so a
client may pipeline several requests before reading the responses.
"""

from __future__ import annotations

import errno
import socket
import struct

import msgspec

from transfer.errors import (AccessDenied, InvalidOp, LimitReached, PeerUnavailable, ProtocolError,
                             SegmentNotFound, TransferError, TransferTimeout)

MAGIC = 0x4B565450  # "KVTP"
VERSION = 1
REQ = struct.Struct("<IBBHIQQQ")
RESP = struct.Struct("<IBBHQQ")
MAX_CONTROL = 1 << 20
# Longest payload one frame may announce: a garbage header must not make the server drain forever.
MAX_FRAME = 1 << 31

FLAG_GRANT = 1  # request flags: a grant follows the header

# opcodes (READ/WRITE match transfer.batch)
OP_READ = 1
OP_WRITE = 2
OP_CONTROL = 3
OP_PING = 4

# statuses
OK = 0
E_NO_SEGMENT = 1
E_RANGE = 2
E_VERSION = 3
E_BAD_REQUEST = 4
E_INTERNAL = 5
E_FORBIDDEN = 6  # no grant, or one that does not cover the op (forged, expired, other op or range)
E_UNAUTHORIZED = 7  # the connection did not authenticate (req_id 0: the server closes it)
E_LIMIT = 8  # a limit of the server (connection caps); req_id 0: the server closes the connection

SOCK_BUF = 8 << 20  # kernel buffers of a data connection, each way (`framing.tune`)


class Hello(msgspec.Struct, tag="hello"):
    """Control request: who is calling (for logs) and which protocol version it speaks."""

    engine: str
    version: int = VERSION


class QPInfo(msgspec.Struct, frozen=True):
    """What the other end needs to move an RC queue pair to RTR: its number, start PSN, address."""

    qpn: int
    psn: int
    lid: int
    gid: bytes
    mtu: int


class RdmaConnect(msgspec.Struct, tag="rdma_connect"):
    """Control request: set up `len(qps)` RC queue pairs against the server's device."""

    engine: str
    qps: list[QPInfo]
    version: int = VERSION


class RdmaAccept(msgspec.Struct, tag="rdma_accept"):
    qps: list[QPInfo]
    version: int = VERSION


class ControlError(msgspec.Struct, tag="error"):
    message: str
    version: int = VERSION


Control = Hello | RdmaConnect | RdmaAccept | ControlError
CONTROL_ENCODER = msgspec.msgpack.Encoder()
CONTROL_DECODER = msgspec.msgpack.Decoder(Control)


def map_os_error(exc: OSError, what: str) -> Exception:
    """An OSError from a socket call -> the transfer error a caller should see."""
    if isinstance(exc, (socket.timeout, TimeoutError)) or exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
        return TransferTimeout(f"{what}: peer did not answer in time")
    return PeerUnavailable(f"{what}: {exc}")


_STATUS_ERRORS = {E_FORBIDDEN: AccessDenied, E_UNAUTHORIZED: AccessDenied, E_LIMIT: LimitReached,
                  E_NO_SEGMENT: SegmentNotFound, E_RANGE: InvalidOp, E_VERSION: ProtocolError,
                  E_BAD_REQUEST: ProtocolError}


def status_error(status: int, message: str) -> Exception:
    """An error status of a response -> the transfer error a caller should see."""
    return _STATUS_ERRORS.get(status, TransferError)(message)

