"""The router's hop client (kvpool/router/hop.py) against a real uvicorn on loopback: whole and
chunked answers, keep-alive reuse, a connection the server closed while idle, a stream the client
leaves (the server sees it go), and the failures it must report as `HopError`."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn

from kvpool.router.hop import Hop, HopError


class _App:
    """/echo: the body's length, the caller's port and a header, as JSON (Content-Length);
    /stream: n NDJSON lines, chunked, one every `gap` s; notes when a client left it."""

    def __init__(self):
        self.left = threading.Event()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        body, more = b"", True
        while more:
            msg = await receive()
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
        if scope["path"] == "/echo":
            doc = {"n": len(body), "port": scope["client"][1], "method": scope["method"],
                   "token": dict(scope["headers"]).get(b"authorization", b"").decode()}
            data = json.dumps(doc).encode()
            await send({"type": "http.response.start", "status": 201,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
            await send({"type": "http.response.body", "body": data})
            return
        n, gap = json.loads(body)["n"], json.loads(body).get("gap", 0.0)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/x-ndjson")]})

        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass
            self.left.set()

        watcher = asyncio.ensure_future(watch())
        try:
            for i in range(n):
                if watcher.done():  # the client left
                    return
                # two lines in one chunk, and one line split over two chunks
                if i == 1:
                    await send({"type": "http.response.body", "body": b'{"i": 1}\n{"i"', "more_body": True})
                    await send({"type": "http.response.body", "body": b': 2}\n', "more_body": True})
                elif i != 2:
                    await send({"type": "http.response.body", "body": b'{"i": %d}\n' % i, "more_body": True})
                await asyncio.sleep(gap)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()


@pytest.fixture(scope="module")
def server():
    app = _App()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=1))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.01)
    yield app, f"http://127.0.0.1:{sock.getsockname()[1]}"
    srv.should_exit = True
    thread.join(10)


async def _echo(hop, url, body=b"{}", headers=None):
    resp = await hop.request(url, "/echo", body, headers)
    try:
        return resp.status, json.loads(await resp.read())
    finally:
        resp.release()


def test_whole_answers_reuse_one_connection(server):
    _, url = server

    async def main():
        hop = Hop({"Authorization": "Bearer t0k"})
        try:
            first = await _echo(hop, url, b"x" * 100)
            second = await _echo(hop, url, b"y" * 200_000)  # a large body: written, then drained
            return first, second
        finally:
            await hop.close()

    (s1, a), (s2, b) = asyncio.run(main())
    assert (s1, a["n"], a["token"]) == (201, 100, "Bearer t0k")
    assert (s2, b["n"]) == (201, 200_000)
    assert a["port"] == b["port"]  # kept alive
    assert a["method"] == "POST"


def test_a_get_without_a_body(server):
    _, url = server

    async def main():
        hop = Hop()
        try:
            return [await _echo(hop, url, None) for _ in range(2)]
        finally:
            await hop.close()

    (s1, a), (s2, b) = asyncio.run(main())
    assert (s1, a["method"], a["n"]) == (201, "GET", 0) and (s2, b["method"]) == (201, "GET")
    assert a["port"] == b["port"]  # kept alive


def test_a_connection_the_server_closed_while_idle_is_replaced(server):
    _, url = server

    async def main():
        hop = Hop(idle_s=30)  # longer than the server's 1 s keep-alive
        try:
            _, a = await _echo(hop, url)
            await asyncio.sleep(1.6)  # the server closes the idle connection
            _, b = await _echo(hop, url)
            return a, b
        finally:
            await hop.close()

    a, b = asyncio.run(main())
    assert a["port"] != b["port"]


def test_chunked_lines_arrive_whole_and_in_order(server):
    _, url = server

    async def main():
        hop = Hop()
        try:
            resp = await hop.request(url, "/stream", json.dumps({"n": 5}).encode())
            try:
                return resp.status, [json.loads(line)["i"] async for line in resp.lines()]
            finally:
                resp.release()
        finally:
            await hop.close()

    assert asyncio.run(main()) == (200, [0, 1, 2, 3, 4])


def test_a_stream_left_midway_closes_its_connection(server):
    app, url = server
    app.left.clear()

    async def main():
        hop = Hop()
        try:
            resp = await hop.request(url, "/stream", json.dumps({"n": 200, "gap": 0.05}).encode())
            lines = resp.lines()
            first = await anext(lines)
            await lines.aclose()
            resp.release()
            assert not hop._idle.get(resp._key)  # not pooled: its answer was not read to its end
            return json.loads(first)
        finally:
            await hop.close()

    assert asyncio.run(main()) == {"i": 0}
    assert app.left.wait(5), "the server never saw the client leave the stream"


def test_failures_are_hop_errors():
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()  # nothing listens here now

    async def not_http(reader, writer):
        await reader.read(100)
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await writer.drain()
        writer.close()

    async def silent(reader, writer):
        await asyncio.sleep(5)

    async def main():
        errors = []
        hop = Hop(read_timeout=0.3)
        for handler in (not_http, silent):
            srv = await asyncio.start_server(handler, "127.0.0.1", 0)
            other = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
            with pytest.raises(HopError) as info:
                await hop.request(other, "/x", b"{}")
            errors.append(info.value)
            srv.close()
        with pytest.raises(HopError) as info:
            await hop.request(f"http://127.0.0.1:{port}", "/x", b"{}")
        errors.append(info.value)
        await hop.close()
        return errors

    garbage, timeout, refused = asyncio.run(main())
    assert "not an HTTP answer" in str(garbage) and not garbage.refused
    assert "TimeoutError" in str(timeout) and not timeout.refused
    assert "cannot connect" in str(refused) and refused.refused  # nothing listens: the router marks it down


def test_a_stream_that_stalls_times_out(server):
    """The read timeout holds between two chunks of a stream too (the watchdog aborts the call)."""
    _, url = server

    async def main():
        hop = Hop(read_timeout=0.3)
        got = []
        try:
            resp = await hop.request(url, "/stream", json.dumps({"n": 3, "gap": 1.5}).encode())
            try:
                with pytest.raises(HopError) as info:
                    async for line in resp.lines():
                        got.append(json.loads(line)["i"])
            finally:
                resp.release()
            return got, str(info.value)
        finally:
            await hop.close()

    got, error = asyncio.run(main())
    assert got == [0] and "TimeoutError" in error  # gave up before the next line came


def test_idle_connections_past_their_age_are_closed(server):
    _, url = server

    async def main():
        hop = Hop(idle_s=0.2)
        try:
            await _echo(hop, url)
            pooled = sum(len(v) for v in hop._idle.values())
            await asyncio.sleep(1.3)  # the watchdog looks every second
            return pooled, sum(len(v) for v in hop._idle.values())
        finally:
            await hop.close()

    assert asyncio.run(main()) == (1, 0)


def test_a_body_without_length_runs_to_the_connection_end():
    async def old_server(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\n\r\nhello, ")
        await writer.drain()
        writer.write(b"world")
        writer.close()

    async def main():
        srv = await asyncio.start_server(old_server, "127.0.0.1", 0)
        hop = Hop()
        try:
            resp = await hop.request(f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}", "/", b"{}")
            body = await resp.read()
            resp.release()
            return body, sum(len(v) for v in hop._idle.values())
        finally:
            await hop.close()
            srv.close()

    assert asyncio.run(main()) == (b"hello, world", 0)


def test_a_call_cancelled_while_waiting_closes_its_connection():
    """A caller cancelled before its answer came (its client left): the call's connection is
    closed at once, not left open for the watchdog (600 s by default)."""

    async def main():
        hop = Hop()
        never = await asyncio.start_server(lambda r, w: asyncio.sleep(10), "127.0.0.1", 0)  # never answers
        try:
            task = asyncio.ensure_future(hop.request(f"http://127.0.0.1:{never.sockets[0].getsockname()[1]}",
                                                     "/x", b"{}"))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return len(hop._calls), sum(len(v) for v in hop._idle.values())
        finally:
            never.close()
            await hop.close()

    assert asyncio.run(main()) == (0, 0)
