"""The pool RPC's frame and how a receiver reads one.

Frame: a 16-byte header `<HHIQ` = (protocol version, flags, message length, payload length),
then the message (msgpack of a `kvpool.messages` struct), then the payload bytes. Payloads are
read straight into their destination (`recv_into` a store's arena or the caller's buffer) and
sent straight from their source (`sendmsg` of memoryviews, `transfer.framing.send_all`).

Invariants: whatever payload a handler leaves unread is drained (`Payload.drain`), so the stream
stays in frame; a frame with a wrong version or an undecodable message cannot be trusted and
ends its connection.
"""

from __future__ import annotations

import socket
import struct
import time
from typing import Any, Sequence

import msgspec

from kvpool.errors import InvalidArgument
from kvpool.messages import PROTOCOL_VERSION, Reply, Request
from kvpool.rpc.spin import STREAM_POLLS, STREAM_SPIN_MIN, Spin, SpinPolicy
from transfer.framing import (DONTWAIT, IOV_MAX, drain, recv_paced, recv_polling, sched_yield, send_all,
                              shutdown)

HEADER = struct.Struct("<HHIQ")
FLAG_ONEWAY = 1
FLAG_SPIN = 2  # in a reply: the server sees this client as its only active one (`kvpool.rpc.spin`)
MAX_MESSAGE = 64 << 20
MAX_PAYLOAD = 1 << 36
RECV_BUFFER = 16 << 10  # a server connection's read-ahead (header, message, payload start)

encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)


def frame(msg: Any, payload_len: int, flags: int = 0) -> list[Any]:
    """Header and message of a frame (its payload buffers follow them)."""
    body = encoder.encode(msg)
    return [HEADER.pack(PROTOCOL_VERSION, flags, len(body), payload_len), body]


def send_frame(sock: socket.socket, msg: Any, buffers: Sequence[Any] = (), flags: int = 0) -> None:
    """Send one frame: header and message in one small buffer, then the payload `buffers` as they
    are, in one `sendmsg` when the kernel takes it all (a blocking socket nearly always does);
    what is left goes through `send_all`."""
    body = encoder.encode(msg)
    if not buffers:
        sock.sendall(HEADER.pack(PROTOCOL_VERSION, flags, len(body), 0) + body)
        return
    nbytes = payload_nbytes(buffers)
    head = HEADER.pack(PROTOCOL_VERSION, flags, len(body), nbytes) + body
    parts = [head, *buffers]
    sent = sock.sendmsg(parts) if len(parts) <= IOV_MAX else 0
    if sent < len(head) + nbytes:
        send_all(sock, after(parts, sent))


def payload_nbytes(buffers: Sequence[Any]) -> int:
    """The bytes in payload `buffers` (a single memoryview, a put's or a get's: the common case)."""
    if not buffers:
        return 0
    if len(buffers) == 1 and type(buffers[0]) is memoryview:
        return buffers[0].nbytes
    return sum(b.nbytes if type(b) is memoryview else memoryview(b).nbytes for b in buffers)


def after(parts: Sequence[Any], sent: int) -> list[memoryview]:
    """What is left of `parts` (bytes-like) once the first `sent` bytes went out."""
    views = [v if type(v) is memoryview else memoryview(v) for v in parts]
    views = [v.cast("B") if v.format != "B" or v.ndim != 1 else v for v in views]
    i = 0
    while i < len(views) and sent >= views[i].nbytes:
        sent -= views[i].nbytes
        i += 1
    rest = views[i:]
    if rest and sent:
        rest[0] = rest[0][sent:]
    return rest


def parse_address(address: str) -> tuple[str, int]:
    """"host:port" -> (host, port), with a typed error for anything else."""
    if not isinstance(address, str) or ":" not in address:
        raise InvalidArgument(f"address must be host:port, got {address!r}")
    host, _, port = address.rpartition(":")
    try:
        port_n = int(port)
    except ValueError:
        raise InvalidArgument(f"address must be host:port, got {address!r}") from None
    if not host or not 0 < port_n < 65536:
        raise InvalidArgument(f"address must be host:port, got {address!r}")
    return host.strip("[]"), port_n


def unix_name(address: str) -> str:
    """"@name" (abstract) -> the sockaddr string bind/connect take."""
    return "\0" + address[1:] if address.startswith("@") else address


class Reader:
    """A connection's receive buffer: one `recv` brings a frame's header, message and the start of
    its payload (a small request, often all of it), instead of one syscall per part."""

    __slots__ = ("sock", "buf", "view", "start", "end")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray(RECV_BUFFER)
        self.view = memoryview(self.buf)
        self.start = 0
        self.end = 0

    def fill(self, need: int, spin: Spin | None = None, policy: SpinPolicy | None = None, me: int = 0) -> None:
        """Have at least `need` (<= the buffer's size) unread bytes buffered; with `spin`, first
        poll without blocking as it allows; with `policy` (a server thread `me`), only while
        `policy.alone(me)`, and `me` leaves `policy.spinning` when its polls end without data:
        a thread blocked in recv is not spinning, and while it counted as such no other
        connection of the server was spun for (an idle pooled connection stopped them all)."""
        if self.end - self.start >= need:
            return
        if self.start:
            if self.start == self.end:
                self.start = self.end = 0
            elif len(self.buf) - self.start < need:
                n = self.end - self.start
                self.buf[:n] = bytes(self.view[self.start:self.end])
                self.start, self.end = 0, n
        view, sock = self.view, self.sock
        polls = spin.polls if spin is not None else 0
        timed = spin is not None and not polls  # spinning is off: time this wait (`Spin.waited`)
        while self.end - self.start < need:
            if polls:
                if policy is not None and not policy.alone(me):  # another connection needs the CPU
                    polls = 0
                    policy.spinning.discard(me)  # about to block
                    continue
                try:
                    k = sock.recv_into(view[self.end:], 0, DONTWAIT)
                    spin.won()
                    polls = 0
                except BlockingIOError:
                    polls -= 1
                    if not polls:
                        spin.lost()
                        if policy is not None:
                            policy.spinning.discard(me)  # about to block
                    sched_yield()
                    continue
            elif timed:
                timed = False
                t0 = time.monotonic_ns()
                k = sock.recv_into(view[self.end:])
                spin.waited(time.monotonic_ns() - t0)
            else:
                k = sock.recv_into(view[self.end:])
            if k == 0:
                raise ConnectionError("peer closed the connection")
            self.end += k

    def take_into(self, view: memoryview) -> int:
        """Copy up to len(view) buffered bytes into `view`; how many were copied."""
        k = min(self.end - self.start, len(view))
        if k:
            view[:k] = self.view[self.start:self.start + k]
            self.start += k
        return k

    def discard(self, n: int) -> int:
        """Drop up to n buffered bytes; how many were dropped."""
        k = min(self.end - self.start, n)
        self.start += k
        return k


class Payload:
    """The payload of the frame being handled; read it once, in order, or leave it to be drained.
    Its bytes arrive straight into the reader's buffers: nothing is allocated for an announced
    length (`read` allocates what it is asked for). `pace`: bytes each receive tick must bring
    (`transfer.framing.recv_paced`; a server's minimum body rate), else the sender is cut."""

    __slots__ = ("_sock", "length", "remaining", "_reader", "spin", "pace")

    def __init__(self, sock: socket.socket, length: int, reader: Reader | None = None, spin: bool = False,
                 pace: int = 0):
        self._sock = sock
        self.length = length
        self.remaining = length
        self._reader = reader  # its buffered bytes come first
        self.spin = spin  # the sole active client's: poll for large payloads instead of sleeping
        self.pace = pace

    def read_into(self, view: memoryview) -> None:
        n = len(view)
        if n > self.remaining:
            raise InvalidArgument(f"payload is shorter than announced ({self.remaining} < {n})")
        got = self._reader.take_into(view) if self._reader is not None else 0
        if got < n:
            rest = view[got:] if got else view
            if self.spin and len(rest) >= STREAM_SPIN_MIN:
                recv_polling(self._sock, rest, STREAM_POLLS, self.pace)
            else:
                recv_paced(self._sock, rest, self.pace)
        self.remaining -= n

    def read(self, n: int | None = None) -> bytearray:
        buf = bytearray(self.remaining if n is None else n)
        self.read_into(memoryview(buf))
        return buf

    def skip(self, n: int) -> None:
        """Discard the next n bytes (an item the handler refused)."""
        n = min(n, self.remaining)
        if n and self._reader is not None:
            k = self._reader.discard(n)
            self.remaining -= k
            n -= k
        if n:
            drain(self._sock, n, self.pace)
            self.remaining -= n

    def drain(self) -> None:
        self.skip(self.remaining)

    def cut(self) -> None:
        """Close the connection under this payload (from another thread): its reader wakes with
        an error. For a sender past a deadline."""
        shutdown(self._sock)
