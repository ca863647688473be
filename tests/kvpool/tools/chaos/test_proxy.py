"""The chaos campaign's fault proxy, on a real echo server over loopback: forward, delay,
blackhole, cut, heal, retarget."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kvpool.tools.chaos.proxy import FaultProxy


@pytest.fixture
def echo():
    servers = []

    def make() -> str:
        srv = socket.create_server(("127.0.0.1", 0))
        servers.append(srv)

        def serve() -> None:
            while True:
                try:
                    conn, _ = srv.accept()
                except OSError:
                    return
                threading.Thread(target=lambda c=conn: _echo(c), daemon=True).start()

        threading.Thread(target=serve, daemon=True).start()
        return "127.0.0.1:%d" % srv.getsockname()[1]

    yield make
    for s in servers:
        s.close()


def _echo(conn: socket.socket) -> None:
    with conn:
        try:
            while data := conn.recv(65536):
                conn.sendall(data)
        except OSError:
            pass


def _connect(proxy: FaultProxy, timeout: float = 2.0) -> socket.socket:
    host, port = proxy.address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout)


def _roundtrip(s: socket.socket, payload: bytes = b"ping") -> bytes:
    s.sendall(payload)
    return s.recv(65536)


def test_forwards_then_delays_then_heals(echo):
    proxy = FaultProxy(echo()).start()
    with _connect(proxy) as s:
        assert _roundtrip(s) == b"ping"
        proxy.delay(0.2)
        t = time.monotonic()
        assert _roundtrip(s) == b"ping"
        assert time.monotonic() - t >= 0.35  # both directions delayed (a floor: it cannot be faster)
        proxy.delay(30)
        proxy.heal()
        s.settimeout(10)  # healed: the next round trip does not wait out the 30 s delay
        assert _roundtrip(s) == b"ping"
    proxy.close()


def test_blackhole_forwards_nothing_and_heal_resets(echo):
    proxy = FaultProxy(echo()).start()
    s = _connect(proxy, timeout=0.5)
    assert _roundtrip(s) == b"ping"
    proxy.blackhole()
    s.sendall(b"lost")
    with pytest.raises(socket.timeout):
        s.recv(10)
    proxy.heal()  # the held-back connection is dropped; new ones work
    time.sleep(0.1)
    with pytest.raises(OSError):
        s.sendall(b"x")
        assert s.recv(10) == b""
        raise ConnectionResetError
    s.close()
    with _connect(proxy) as s2:
        assert _roundtrip(s2) == b"ping"
    proxy.close()


def test_cut_resets_open_connections_and_refuses_new_ones(echo):
    proxy = FaultProxy(echo()).start()
    s = _connect(proxy)
    assert _roundtrip(s) == b"ping"
    proxy.cut()
    time.sleep(0.1)
    with pytest.raises(OSError):
        s.sendall(b"x")
        if not s.recv(10):
            raise ConnectionResetError
    s.close()
    # accepted, then reset at once: the reset can reach the client during connect itself
    # (BrokenPipeError / ConnectionResetError from create_connection) or on first use
    with pytest.raises(OSError):
        with _connect(proxy) as s2:
            s2.sendall(b"x")
            if not s2.recv(10):
                raise ConnectionResetError
    proxy.heal()
    with _connect(proxy) as s3:
        assert _roundtrip(s3) == b"ping"
    proxy.close()


def test_retarget_sends_new_connections_elsewhere(echo):
    first, second = echo(), echo()
    proxy = FaultProxy(first).start()
    proxy.retarget(second)
    assert proxy.upstream == second
    with _connect(proxy) as s:
        assert _roundtrip(s) == b"ping"
    proxy.close()
