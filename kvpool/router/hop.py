"""The router's HTTP/1.1 client for the calls on a request's path to a reference worker
(POST /v1/prefill, /v1/decode, /v1/generate) and for its polls of each worker (GET /load):
keep-alive connections over asyncio streams.

Why not aiohttp, which the router keeps for admin calls and other engines' workers: each call on
a request's path is on its TTFT or its first decode token, and aiohttp's machinery cost ~0.3 ms
per call on each side of the worker (send, and reading the answer), about 40% of the router's
own share of TTFT (BENCHMARKS.md, router section). The polls (4 a second per worker) use it too:
an idle router with two workers went from 11 to 8 ms of CPU a second. This client does only what
a worker's uvicorn answers: a status line and headers, then a body by `Content-Length` or the
chunked transfer coding.

    resp = await hop.request(url, "/v1/prefill", body, headers)
    try:
        status, data = resp.status, await resp.read()      # or: async for line in resp.lines()
    finally:
        resp.release()   # the connection goes back to the pool only if its answer was read whole

Connections: per (scheme, host, port), idle ones are reused while younger than `idle_s` (under
uvicorn's 5 s keep-alive, so the worker has not closed them) and not closed by the worker; a
connection whose answer was not read to its end (a stream the client left) is closed, which is
also how the worker learns to stop that stream. Failures (refused, reset, timed out, not HTTP)
raise `HopError`; `https://` URLs connect with TLS (the system's CA store).

Read timeout: a call whose worker sends nothing for `read_timeout` s (before its answer, or
between two chunks of a stream) is aborted by a watchdog that looks every second, instead of a
timer per read: `asyncio.timeout` around each read was ~15% of this client's time on a request.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
import time
from typing import AsyncIterator
from urllib.parse import urlsplit


class HopError(Exception):
    """The worker could not be reached, or its answer broke off or was not HTTP. `refused`: the
    connection itself was refused (nothing listens there: the worker is gone)."""

    def __init__(self, message: str, refused: bool = False):
        super().__init__(message)
        self.refused = refused


class _Call:
    """One request in flight on one connection, as the watchdog sees it."""

    __slots__ = ("writer", "last", "timed_out")

    def __init__(self, writer: asyncio.StreamWriter, now: float):
        self.writer, self.last, self.timed_out = writer, now, False


class Response:
    def __init__(self, hop: "Hop", key: tuple, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 head: bytes, call: _Call):
        """`head`: the status line and headers; `ValueError` when they are not HTTP/1.x."""
        status_line, *lines = head.split(b"\r\n")
        version, status, *_ = status_line.split(b" ", 2)
        if not version.startswith(b"HTTP/1."):
            raise ValueError(status_line[:40])
        self.status = int(status)
        headers = {}
        for line in lines:
            name, sep, value = line.partition(b":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        self._hop, self._key, self._reader, self._writer, self._call = hop, key, reader, writer, call
        self._chunked = b"chunked" in headers.get(b"transfer-encoding", b"").lower()
        # neither a length nor chunks: the body runs to the connection's end (HTTP/1.0 style)
        self._to_eof = not self._chunked and b"content-length" not in headers
        self._left = int(headers.get(b"content-length", b"0") or 0) if not self._chunked else 0
        self._keep = headers.get(b"connection", b"").lower() != b"close" and not self._to_eof
        self._done = False
        self._released = False

    def _broke(self, exc: BaseException) -> HopError:
        return HopError(f"the answer broke off: {self._hop._why(self._call, exc)}")

    async def _chunks(self) -> AsyncIterator[bytes]:
        r, call, clock = self._reader, self._call, self._hop._clock
        if not self._chunked:
            data = await self.read()
            if data:
                yield data
            return
        try:
            while True:
                size = int((await r.readuntil(b"\r\n")).split(b";", 1)[0], 16)
                data = await r.readexactly(size + 2)
                call.last = clock()
                if size == 0:  # the last chunk (no trailers are sent by uvicorn)
                    self._done = True
                    return
                yield data[:-2]
        except (OSError, EOFError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            raise self._broke(exc) from None

    async def read(self) -> bytes:
        if not self._chunked:  # (the usual answer: one read, no generator)
            try:
                if self._to_eof:
                    data = await self._reader.read()
                else:
                    data = await self._reader.readexactly(self._left) if self._left else b""
            except (OSError, asyncio.IncompleteReadError) as exc:
                raise self._broke(exc) from None
            self._done = True
            return data
        return b"".join([c async for c in self._chunks()])

    async def lines(self) -> AsyncIterator[bytes]:
        """The body split at newlines (NDJSON), each line as soon as it has arrived."""
        rest = b""
        async for chunk in self._chunks():
            if rest:
                chunk, rest = rest + chunk, b""
            *whole, rest = chunk.split(b"\n")
            for line in whole:
                yield line
        if rest:
            yield rest

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._hop._calls.discard(self._call)
        if self._done and self._keep and not self._reader.at_eof():
            self._hop._idle.setdefault(self._key, []).append((self._reader, self._writer, self._hop._clock()))
        else:
            self._writer.close()


class Hop:
    def __init__(self, headers: dict[str, str] | None = None, *, connect_timeout: float = 5.0,
                 read_timeout: float = 600.0, idle_s: float = 4.0):
        self._headers = b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in (headers or {}).items())
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.idle_s = idle_s
        self._idle: dict[tuple, list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]]] = {}
        self._tls: ssl.SSLContext | None = None
        self._calls: set[_Call] = set()
        self._watchdog: asyncio.Task | None = None
        self._clock = time.monotonic

    async def _connect(self, key: tuple) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bool]:
        idle = self._idle.get(key)
        now = self._clock()
        while idle:
            reader, writer, since = idle.pop()
            if now - since < self.idle_s and not reader.at_eof() and not writer.is_closing():
                return reader, writer, True
            writer.close()
        tls, host, port, _ = key
        if tls and self._tls is None:
            self._tls = ssl.create_default_context()
        try:
            async with asyncio.timeout(self.connect_timeout):
                reader, writer = await asyncio.open_connection(host, port, ssl=self._tls if tls else None,
                                                               limit=1 << 20)
        except (OSError, TimeoutError) as exc:
            raise HopError(f"cannot connect to {host}:{port}: {type(exc).__name__}: {exc}",
                           refused=isinstance(exc, ConnectionRefusedError)) from None
        return reader, writer, False

    async def request(self, url: str, path: str, body: bytes | None, headers: dict[str, str] | None = None) -> Response:
        """POST `body` (JSON) to `url + path`, or GET it when `body` is None; returns once the
        status line and headers are in."""
        key = _target(url)
        if body is None:
            body, head = b"", b"GET " + path.encode() + b" HTTP/1.1\r\nhost: " + key[3] + b"\r\n"
        else:
            head = (b"POST " + path.encode() + b" HTTP/1.1\r\nhost: " + key[3] + b"\r\ncontent-type: application/json"
                    b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n")
        head += self._headers + b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in (headers or {}).items()
                                         if k.lower() != "content-type") + b"\r\n"
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.ensure_future(self._watch())
        for attempt in range(2):
            reader, writer, reused = await self._connect(key)
            call = _Call(writer, self._clock())
            self._calls.add(call)
            try:
                writer.write(head + body if len(body) < 65536 else head)
                if len(body) >= 65536:
                    writer.write(body)
                    await writer.drain()
                block = await reader.readuntil(b"\r\n\r\n")
                call.last = self._clock()
                return Response(self, key, reader, writer, block, call)
            except BaseException as exc:
                self._calls.discard(call)
                writer.close()  # (cancelled: its client left; the worker sees the connection go)
                if not isinstance(exc, Exception):
                    raise
                # A reused connection the worker closed before reading anything (its keep-alive ran
                # out in between): nothing was processed, so once more on a new connection.
                if (isinstance(exc, asyncio.IncompleteReadError) and not exc.partial and reused and attempt == 0
                        and not call.timed_out):
                    continue
                if not isinstance(exc, (OSError, ValueError, asyncio.IncompleteReadError,
                                        asyncio.LimitOverrunError)):
                    raise
                raise HopError(f"{url}{path}: {self._why(call, exc)}") from None
        raise AssertionError("unreachable")

    def _why(self, call: _Call, exc: BaseException) -> str:
        if call.timed_out:
            return f"TimeoutError: nothing for {self.read_timeout:g} s"
        if isinstance(exc, asyncio.IncompleteReadError):
            return "the connection closed before the answer ended"
        if isinstance(exc, ValueError):
            return f"not an HTTP answer: {exc}"
        return f"{type(exc).__name__}: {exc}"

    async def _watch(self) -> None:
        """Abort the calls that have waited `read_timeout` for their next bytes; close the idle
        connections too old to reuse (the worker has closed them, or soon will)."""
        period = min(1.0, self.read_timeout / 4)
        while True:
            await asyncio.sleep(period)
            now = self._clock()
            for call in [c for c in self._calls if now - c.last > self.read_timeout]:
                call.timed_out = True
                self._calls.discard(call)
                call.writer.transport.abort()  # the pending read fails at once
            for conns in self._idle.values():
                while conns and now - conns[0][2] >= self.idle_s:  # oldest first (appended in time order)
                    conns.pop(0)[1].close()

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        for conns in self._idle.values():
            for _, writer, _ in conns:
                writer.close()
        self._idle.clear()


@functools.lru_cache(maxsize=4096)
def _target(url: str) -> tuple[bool, str, int, bytes]:
    """(TLS, host, port, the Host header's value) of a worker URL."""
    parts = urlsplit(url)
    tls = parts.scheme == "https"
    host = parts.hostname or "127.0.0.1"
    port = parts.port or (443 if tls else 80)
    hostport = f"[{host}]" if ":" in host else host
    return tls, host, port, f"{hostport}:{port}".encode()
