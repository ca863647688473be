"""Segment descriptors: what another process needs to reach a registered buffer.

A descriptor is data (msgspec Struct, msgpack on the wire) so the pool can ship it through its
master. Invariants:
- `(engine, name)` names one segment while it is registered; `seg_id` names that one
  registration (never reused by the engine), and `size` never changes.
- `transports` lists what the owner offers for this segment; "shm" is offered only when the
  buffer IS a mapping of `shm_path`, and is usable only by a process on the same host
  (`host_id`, compared by `transfer.route.same_host`).
- `rdma` is set only when the owner registered the buffer with an RDMA device.
"""

from __future__ import annotations

import os

import msgspec

DESCRIPTOR_VERSION = 1


class RdmaEndpoint(msgspec.Struct, frozen=True):
    """Where a segment lives for one-sided RDMA: its virtual address and remote key."""

    addr: int
    rkey: int
    writable: bool = True  # registered for remote WRITE too (False: a READ-only registration)


class SegmentDescriptor(msgspec.Struct, frozen=True):
    name: str
    engine: str
    host: str
    port: int
    size: int
    transports: tuple[str, ...]
    host_id: str = ""
    pid: int = 0
    shm_path: str | None = None
    rdma: RdmaEndpoint | None = None
    seg_id: int = 0  # the owner's number for this registration (the TCP frames carry it)
    version: int = DESCRIPTOR_VERSION

    def to_bytes(self) -> bytes:
        return _ENCODER.encode(self)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> "SegmentDescriptor":
        from transfer.errors import ProtocolError

        try:
            desc = _DECODER.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"not a segment descriptor: {exc}") from exc
        if desc.version != DESCRIPTOR_VERSION:
            raise ProtocolError(f"segment descriptor version {desc.version}, expected {DESCRIPTOR_VERSION}")
        return desc


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(SegmentDescriptor)


def pid_alive(pid: int) -> bool:
    """Whether a process of this host is alive (zombie counts as dead for our purpose)."""
    if pid <= 0:
        return True  # unknown: cannot tell, assume alive
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a SIGKILLed child not yet reaped is a zombie: its memory is gone
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True
