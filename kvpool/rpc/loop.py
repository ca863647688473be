"""`ServeLoop`: one thread that waits on every connection of an `RpcServer` at once (epoll) and
answers the requests that never block right there, so many busy clients cost no thread
hand-offs.

Why (issue 29, measured on 2 cores, 16 client processes of 64 KiB gets over TCP): with a thread
per connection, every request wakes its own thread, which then queues for the GIL behind the
others: 13 futex calls and about 7 context switches per get, and the server's CPU per get rose
from 45 us (one client) to 60 us. Here one thread takes every ready connection from one
`epoll_wait`, reads each request with one non-blocking `recv_into` and sends each reply with one
non-blocking `sendmsg` from where the bytes lie; nobody else wants the GIL meanwhile.

What runs here: requests whose type the server lists as `inline` (a handler that only touches
memory: a get or pin of objects in DRAM, an unpin) and whose whole frame has arrived. Anything
else (a put streaming its payload, a copy from another node, a message bigger than the read
buffer, a bad frame) is handed to the connection's own thread, which is parked while its
connection is in the loop: it serves that request exactly as a thread-per-connection server
does (`RpcServer._one`), and any next one that arrives within `STAY_S`, then gives the connection
back. So handlers that block keep blocking only their own connection, and authentication, limits
and caps (`transfer.listener`) are unchanged: the parked thread holds its connection's place.
A reply of `BIG_REPLY` bytes or more is also written by the connection's thread (its handler ran
here): while one client's megabytes are copied into the kernel, every other client is served.

Invariants:
- A connection is in exactly one place: registered in the loop, or handed to its thread (not
  registered), or closed. Only the loop thread reads from a registered connection; the parked
  thread touches its `Link` only after the loop released `gate`, and the loop only after the
  thread gave it back (`adopt`).
- At most one reply is being sent per connection: while one is partly sent (`out`), the loop
  reads nothing more from that connection. A reply's `release` (unpin) runs exactly once, when its
  last byte is taken by the kernel or when the connection ends first.
- A partial frame waiting in the loop longer than the header timeout, a connection idle longer
  than the idle timeout, and a reply the client does not read for a whole tick end the
  connection (`transfer.framing.Limits`), as on a thread.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from collections import deque
from typing import Any, Callable

import msgspec

from kvpool.messages import PROTOCOL_VERSION
from kvpool.rpc.frame import FLAG_ONEWAY, FLAG_SPIN, HEADER, Payload, Reader, after, request_decoder
from kvpool.rpc.spin import Spin, SpinPolicy
from transfer.framing import DONTWAIT, IOV_MAX, sched_yield, send_all

log = logging.getLogger("kvpool.rpc")

READ = select.EPOLLIN | select.EPOLLRDHUP
WRITE = select.EPOLLOUT
SWEEP_S = 0.5  # how often the loop looks for connections past a timeout
BIG_REPLY = 1 << 20  # a reply this long is written by its connection's thread, not the loop

# May a request of this type be answered on the loop thread? None: always; else asked per
# request with (message, the connection's key scope, `ServerConn.scope`).
Inline = Callable[[Any, str], bool] | None
_NOT_INLINE = object()


class Link:
    """One connection as the loop sees it (`RpcServer._serve` makes it; see the module doc)."""

    __slots__ = ("loop", "sock", "fd", "conn", "reader", "peer", "gate", "closed", "out", "release", "since",
                 "partial", "why", "spin", "replied", "msg", "big")

    def __init__(self, loop: "ServeLoop", sock: socket.socket, conn: Any, reader: Any, peer: str, spin: Spin):
        self.loop = loop
        self.spin = spin  # polls for this client's next request (`kvpool.rpc.spin`)
        self.replied = 0  # when its last reply went out (ns), while it may be spun for
        self.sock = sock
        self.fd = sock.fileno()
        self.conn = conn
        self.reader = reader
        self.peer = peer
        self.gate = threading.Lock()  # held while the thread is parked; the loop releases it
        self.gate.acquire()
        self.closed = False
        self.out: list[memoryview] = []  # the rest of a partly sent reply
        self.release: Callable[[], None] | None = None  # after `out` is sent (or the connection ends)
        self.since = time.monotonic()  # last progress: a request, a reply byte, the adoption
        self.partial = 0.0  # when the buffered part of an unfinished frame began (0: none)
        self.why = ""  # why the loop ended the connection (logged by nobody: the thread reads it)
        self.msg: Any = None  # the request handed over, as the loop decoded it (None: not decoded)
        self.big: tuple[list, Callable[[], None] | None] | None = None  # a reply its thread is to write


class ServeLoop:
    """The loop of one `RpcServer`. `frames(link) -> bool`: handle the complete frames buffered
    on `link` (inline), returning False when the link was handed to its thread or closed;
    `limits`: the server's `transfer.framing.Limits`."""

    def __init__(self, name: str, frames: Callable[[Link], bool], limits: Any, policy: SpinPolicy):
        self.name = name
        self._frames = frames
        self.policy = policy  # spinning for a sole client (`kvpool.rpc.spin`): as a thread would
        self.header_timeout = limits.header_timeout_s or 0.0
        self.idle_timeout = limits.idle_timeout_s or 0.0
        self._ep = select.epoll()
        self._links: dict[int, Link] = {}
        self._adopted: deque[Link] = deque()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._ep.register(self._wake_r, select.EPOLLIN)
        self.closed = False
        self.big_reply = BIG_REPLY
        self.now = time.monotonic()  # when the loop last woke (its clock for timeouts)
        self._thread = threading.Thread(target=self._run, name=f"{name}-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop the loop; every connection still in it ends (its thread wakes and returns)."""
        self.closed = True
        self._wake()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    # -- from any thread ------------------------------------------------------------------------
    def adopt(self, link: Link) -> None:
        """Serve `link` from the loop (a new connection, or one its thread is giving back). Bytes
        already buffered (a pipelined frame) are handled by the loop at once."""
        if link.reader.end > link.reader.start or self.closed:
            self._adopted.append(link)
            self._wake()
            return
        link.since = time.monotonic()
        self._links[link.fd] = link
        try:
            self._ep.register(link.fd, READ)
        except OSError as exc:  # closed meanwhile (the listener shut it down)
            self._links.pop(link.fd, None)
            self._end(link, f"cannot watch the connection: {exc}")

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # already awake (full pipe), or closing

    # -- the loop thread ------------------------------------------------------------------------
    def hand_over(self, link: Link, msg: Any = None) -> None:
        """Give `link` to its parked thread for the request at the head of its buffer (`msg`:
        its message, when decoded already: the thread does not decode it again)."""
        self._forget(link)
        link.msg = msg
        link.gate.release()

    def end(self, link: Link, why: str) -> None:
        """End a connection the loop holds: its pending reply is released, its thread returns."""
        self._forget(link)
        self._end(link, why)

    def send(self, link: Link, parts: list, total: int, release: Callable[[], None] | None) -> bool:
        """Send one reply (`parts`: header+message, then payload buffers; `total` bytes) without
        blocking. What the kernel does not take now is sent as the client reads (`release` after
        the last byte; without `release` the rest is copied first, as the caller may reuse its
        buffers at once). False: the connection broke (and is ended). A reply of `big_reply`
        bytes or more is left for the connection's thread (`Link.big`), which blocks on it while
        the loop serves everyone else: one copy of megabytes here would stall them all."""
        if total >= self.big_reply:
            link.big = (parts, release)
            return True
        sock = link.sock
        try:
            sent = sock.sendmsg(parts, (), DONTWAIT) if len(parts) <= IOV_MAX else 0
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            if release is not None:
                release()
            self.end(link, f"send failed: {exc}")
            return False
        if sent == total:
            if release is not None:
                release()
            return True
        rest = after(parts, sent)
        if release is None:
            rest = [memoryview(bytes(v)) for v in rest]
        link.out, link.release, link.since = rest, release, self.now
        try:
            self._ep.modify(link.fd, WRITE | select.EPOLLRDHUP)
        except OSError as exc:
            self.end(link, f"cannot watch the connection: {exc}")
            return False
        return True

    def _run(self) -> None:
        poll, links, clock = self._ep.poll, self._links, time.monotonic
        next_sweep = clock() + SWEEP_S
        try:
            while not self.closed:
                try:
                    events = poll(SWEEP_S)
                except InterruptedError:
                    continue
                self.now = clock()  # one clock read per wake-up: the links' timestamps
                for fd, ev in events:
                    link = links.get(fd)
                    if link is None:
                        if fd == self._wake_r:
                            self._take_adopted()
                        continue
                    try:
                        if link.out:
                            self._flush(link, ev)
                        else:
                            self._readable(link)
                    except Exception as exc:  # a bug must end one connection, not the loop
                        log.exception("%s: serving %s failed", self.name, link.peer)
                        if fd in links:
                            self.end(link, f"internal error: {exc}")
                now = self.now
                if now >= next_sweep:
                    next_sweep = now + SWEEP_S
                    self._sweep(now)
        finally:
            for link in list(links.values()):
                self.end(link, "the server is stopping")
            self._take_adopted(ending=True)
            self._ep.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _take_adopted(self, ending: bool = False) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        while self._adopted:
            link = self._adopted.popleft()
            if ending or self.closed:
                self._end(link, "the server is stopping")
                continue
            link.since = self.now = time.monotonic()
            self._links[link.fd] = link
            try:
                self._ep.register(link.fd, READ)
            except OSError as exc:
                self._links.pop(link.fd, None)
                self._end(link, f"cannot watch the connection: {exc}")
                continue
            if self._frames(link) and link.reader.end == link.reader.start:
                link.partial = 0.0

    def _readable(self, link: Link) -> None:
        reader = link.reader
        if reader.start == reader.end:
            reader.start = reader.end = 0
        elif len(reader.buf) - reader.end < 4096 and reader.start:  # room for a whole small frame
            n = reader.end - reader.start
            reader.buf[:n] = bytes(reader.view[reader.start:reader.end])
            reader.start, reader.end = 0, n
        try:
            k = link.sock.recv_into(reader.view[reader.end:], 0, DONTWAIT)
        except BlockingIOError:
            return
        except OSError as exc:
            self.end(link, f"receive failed: {exc}")
            return
        if k == 0:
            self.end(link, "peer closed the connection")
            return
        if link.replied:  # spinning was off for this wait: a short one turns it back on
            link.spin.waited(time.monotonic_ns() - link.replied)
            link.replied = 0
        reader.end += k
        if not link.partial:
            link.partial = self.now
        if self._frames(link) and reader.end == reader.start:
            link.partial = 0.0
            link.since = self.now
            if link.spin.cap and not link.out and self.policy.loop_may_spin(link.fd):
                self._spin(link)

    def _spin(self, link: Link) -> None:
        """Poll the sole active client for its next request instead of going back to epoll (a
        wake-up costs more than the tens of microseconds it often takes), as long as it keeps
        coming back within the spin (`Spin`); each request found is answered at once."""
        reader, sock, spin, policy = link.reader, link.sock, link.spin, self.policy
        polls = spin.polls
        while polls:
            try:
                k = sock.recv_into(reader.view[reader.end:], 0, DONTWAIT)
            except BlockingIOError:
                polls -= 1
                if not polls:
                    spin.lost()
                    break
                sched_yield()
                continue
            except OSError as exc:
                self.end(link, f"receive failed: {exc}")
                return
            if k == 0:
                self.end(link, "peer closed the connection")
                return
            spin.won()
            reader.end += k
            link.partial = link.since = self.now = time.monotonic()
            if not self._frames(link) or link.out or reader.end != reader.start:
                return  # handed over, ended, sending, or a frame still arriving: epoll takes over
            link.partial = 0.0
            if not policy.loop_may_spin(link.fd):
                return
            polls = spin.polls
        if spin.cap and not spin.polls:
            link.replied = time.monotonic_ns()  # time the next wait (`Spin.waited`)

    def _flush(self, link: Link, ev: int) -> None:
        if ev & (select.EPOLLERR | select.EPOLLHUP):
            self.end(link, "peer closed the connection mid-reply")
            return
        out = link.out
        try:
            sent = link.sock.sendmsg(out[:IOV_MAX], (), DONTWAIT)
        except BlockingIOError:
            return
        except OSError as exc:
            self.end(link, f"send failed: {exc}")
            return
        link.out = out = after(out, sent)
        link.since = self.now
        if out:
            return
        release, link.release = link.release, None
        if release is not None:
            release()
        try:
            self._ep.modify(link.fd, READ)
        except OSError as exc:
            self.end(link, f"cannot watch the connection: {exc}")
            return
        if self._frames(link) and link.reader.end == link.reader.start:
            link.partial = 0.0

    def _sweep(self, now: float) -> None:
        header, idle = self.header_timeout, self.idle_timeout
        for link in list(self._links.values()):
            if link.out:
                if header and now - link.since > header:
                    self.end(link, f"the client read nothing of its reply for a whole tick ({header:.3g}s)")
            elif link.reader.end > link.reader.start:
                if header and link.partial and now - link.partial > header:
                    self.end(link, f"frame not finished within the header timeout ({header:.3g}s)")
            elif idle and now - link.since > idle:
                self.end(link, f"idle for {idle:.3g}s")

    def _forget(self, link: Link) -> None:
        if self._links.pop(link.fd, None) is not None:
            try:
                self._ep.unregister(link.fd)
            except OSError:
                pass

    @staticmethod
    def _end(link: Link, why: str) -> None:
        release, link.release, link.out = link.release, None, []
        if link.big is not None:
            release, link.big = link.big[1], None
        if release is not None:
            try:
                release()
            except Exception:
                log.exception("releasing a reply's resources failed")
        link.why = why
        link.closed = True
        link.gate.release()


# How long a connection's thread keeps its connection after a request the loop handed over, for the
# next one: a client putting back to back sends it a client's CPU time (50-90 us here) after the
# reply; waiting here (asleep in poll) saves the trip through the loop (two epoll_ctl, two wake-ups).
# 64 KiB TCP puts, one client (scripts/bisect_ab.py, 2026-12-06): 1.46-1.51x the ops/s of giving
# it back at once (server CPU per put 150-160 -> 100-111 us), 1.10x b10075b's (before the loop).
STAY_S = 0.001


def _stays(sock: socket.socket, reader: Reader) -> bool | None:
    """After a handed-over request: True when the next request's header is here within STAY_S
    (the thread serves it), False to give the connection back to the loop (nothing came, or
    only part of a header, which the loop then waits for), None when the peer has gone."""
    hsize = HEADER.size
    if reader.end - reader.start >= hsize:
        return True
    try:
        waiting = select.poll()  # not select(): a server's descriptors may be past FD_SETSIZE
        waiting.register(sock, select.POLLIN)
        if not waiting.poll(STAY_S * 1000):
            return False
        reader.fill(hsize)
    except BlockingIOError:  # a tick passed with the header unfinished: the loop's limits take over
        return False
    except (ConnectionError, OSError):
        return None
    return True


class LoopServing:
    """The `RpcServer` side of its loop (mixed into it): a connection's thread parked between
    requests (`_serve_looped`), and what the loop does with a connection's buffered frames
    (`_frames`). Uses the server's `_loop`, `spin`, `limits`, `inline`, `_one` and `_dispatch`."""

    def _serve_looped(self, conn: Any, reader: Reader, in_process: bool) -> None:
        """Between requests the connection waits in the loop, which answers the inline ones; this
        thread, parked meanwhile, serves each request the loop hands over (`kvpool.rpc.loop`)."""
        loop, policy = self._loop, self.spin
        link = Link(loop, conn.sock, conn, reader, conn.peer, policy.connection(in_process))
        conn.link = link
        loop.adopt(link)
        pace = self.limits.min_per_tick
        busy, me = policy.busy, threading.get_ident()
        while True:
            link.gate.acquire()  # parked until the loop hands a request over or ends the connection
            if link.closed:
                if link.why.startswith(("frame not finished", "the client read nothing", "idle")):
                    log.info("%s: closing %s: %s", self.name, conn.peer, link.why)
                else:
                    log.debug("%s: connection from %s ended: %s", self.name, conn.peer, link.why)
                return
            conn.link = None
            msg, link.msg = link.msg, None
            big, link.big = link.big, None
            busy.add(me)  # the loop spins for nobody meanwhile
            try:
                if big is not None:  # a big reply the loop left to us: blocking, as on a thread of its own
                    try:
                        send_all(conn.sock, big[0])
                    finally:
                        if big[1] is not None:
                            big[1]()
                else:
                    while True:  # this request, then any that follow within STAY_S (`_stays`)
                        now = policy.request_from(link.fd)
                        flags = FLAG_SPIN if link.spin.cap and policy.sole_client(now) else 0
                        if not self._one(conn, reader, flags, bool(flags), pace, msg):
                            return
                        msg = None
                        busy.discard(me)
                        stays = _stays(conn.sock, reader)
                        if stays is None:
                            return
                        if not stays:
                            break
                        busy.add(me)
            finally:
                busy.discard(me)
            conn.link = link
            loop.adopt(link)

    def _frames(self, link: Link) -> bool:
        """On the loop thread: answer the complete inline frames buffered on `link`; hand the
        first other one to the connection's thread. False: the link left the loop (handed over,
        or ended)."""
        reader, conn, loop, policy = link.reader, link.conn, link.loop, self.spin
        buf, view = reader.buf, reader.view
        hsize, unpack_from, decode, inline = HEADER.size, HEADER.unpack_from, request_decoder.decode, self.inline
        spins = link.spin.cap
        while True:
            start = reader.start
            avail = reader.end - start
            if avail < hsize:
                return True
            version, flags, msg_len, payload_len = unpack_from(buf, start)
            need = hsize + msg_len + payload_len
            if version != PROTOCOL_VERSION or need > len(buf):  # bad, or too big to wait for here
                loop.hand_over(link)
                return False
            if avail < need:
                if start + need > len(buf):  # make room for the rest of it
                    buf[:avail] = bytes(view[start:reader.end])
                    reader.start, reader.end = 0, avail
                return True
            try:
                msg = decode(view[start + hsize:start + hsize + msg_len])
            except msgspec.DecodeError:
                loop.hand_over(link)  # its thread answers the error
                return False
            check = inline.get(type(msg), _NOT_INLINE)
            if check is _NOT_INLINE or (check is not None and not check(msg, conn.scope)):
                loop.hand_over(link, msg)  # decoded once: its thread serves it as it is
                return False
            reader.start = start + hsize + msg_len
            conn.oneway = bool(flags & FLAG_ONEWAY)
            conn.replied = False
            conn.flags = FLAG_SPIN if spins and policy.loop_sole_client(policy.request_from(link.fd)) else 0
            self._dispatch(msg, Payload(link.sock, payload_len, reader), conn)
            if link.big is not None:  # its thread writes the reply
                loop.hand_over(link)
                return False
            if link.closed or link.out:  # ended, or its reply is still being sent
                return not link.closed
