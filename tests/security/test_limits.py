"""Resource limits of a real `kvpool serve` (issue 13), each a setting (`[rpc]` of the tree, KVPOOL_*):
stalled connections announcing 64 MiB cost no memory, a stalled NodeWrite's reservation is
reclaimed at the put deadline, idle and header timeouts and the minimum body rate close slow
peers, connection caps refuse with a typed error, and clients refuse oversized replies. After
each attack the legitimate client is still served (a pooled connection the server idle-closed
is reopened, not failed)."""

from __future__ import annotations

import os
import socket
import threading
import time

import msgspec
import pytest

import kvpool
from kvpool import messages as m
from kvpool.config import Settings
from kvpool.errors import KVPoolError, LimitExceeded
from kvpool.messages import PROTOCOL_VERSION
from kvpool.rpc import RpcClient
from kvpool.rpc.frame import HEADER, encoder
from served_support import Serve
from transfer import TransferEngine, wire
from transfer.errors import LimitReached, ProtocolError, TransferError

MiB = 1 << 20
TIGHT = {"KVPOOL_LOCAL_AUTH": "off", "KVPOOL_HEADER_TIMEOUT_S": "0.5", "KVPOOL_IDLE_TIMEOUT_S": "2", "KVPOOL_MIN_BODY_RATE": "256KiB",
         "KVPOOL_MAX_CONNECTIONS": "10", "KVPOOL_MAX_CONNECTIONS_PER_PEER": "6"}
SLOW_TICK = {"KVPOOL_LOCAL_AUTH": "off", "KVPOOL_HEADER_TIMEOUT_S": "30", "KVPOOL_PUT_TIMEOUT_S": "2", "KVPOOL_HEARTBEAT_S": "0.2"}


@pytest.fixture(autouse=True)
def _no_ambient_settings(monkeypatch):
    for name in ("KVPOOL_AUTH_FILE", "KVPOOL_PRINCIPAL", "KVPOOL_MAX_REPLY_BYTES"):
        monkeypatch.delenv(name, raising=False)
    # these limits are those of a pool without authentication (raw frames from the first byte):
    # no per-user keyring either (test_flood.py has the limits of an authenticating pool)
    monkeypatch.setenv("KVPOOL_LOCAL_AUTH", "off")


@pytest.fixture(scope="module")
def tight(tmp_path_factory):
    served = Serve(tmp_path_factory.mktemp("limits-tight") / "serve.log", None, TIGHT, "--dram-capacity", "16MiB")
    try:
        yield served
    finally:
        served.stop()


@pytest.fixture(scope="module")
def slow_tick(tmp_path_factory):
    served = Serve(tmp_path_factory.mktemp("limits-deadline") / "serve.log", None, SLOW_TICK,
                   "--dram-capacity", "64MiB")
    try:
        yield served
    finally:
        served.stop()


def legit(pool: Serve, size: int = 64 << 10) -> None:
    value = os.urandom(size)
    with kvpool.connect(pool.address, data_path="rpc") as client:
        client.put(f"legit/{value[:6].hex()}", value)
        assert client.get(f"legit/{value[:6].hex()}") == value


def closed_within(sock: socket.socket, seconds: float) -> float:
    """Seconds until the server closes `sock` (reading and dropping whatever it sends)."""
    t0 = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"the server kept the connection open for {seconds}s") from None
    return time.monotonic() - t0


def rpc_frame(msg, payload_len: int = 0, msg_len: int | None = None) -> bytes:
    body = encoder.encode(msg)
    return HEADER.pack(PROTOCOL_VERSION, 0, len(body) if msg_len is None else msg_len, payload_len) + body


def connect_from(pool: Serve, port: int, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((source, 0))
    sock.connect((pool.host, port))
    return sock


# ---------------------------------------------------------------- memory

def test_stalled_connections_announcing_64_MiB_cost_no_memory(slow_tick):
    seg = slow_tick.segment()
    before = slow_tick.rss_anon()
    socks = []
    try:
        for _ in range(3):  # an RPC message of 64 MiB announced, 64 KiB sent
            s = socket.create_connection((slow_tick.host, slow_tick.port))
            s.sendall(HEADER.pack(PROTOCOL_VERSION, 0, 64 * MiB, 0) + b"\x91" * (64 << 10))
            socks.append(s)
        for _ in range(3):  # a data-port WRITE of 64 MiB announced (more than the arena: drained)
            s = socket.create_connection((slow_tick.host, seg.port))
            s.sendall(wire.REQ.pack(wire.MAGIC, wire.VERSION, wire.OP_WRITE, 0, seg.seg_id, 1, 0, 64 * MiB)
                      + b"\0" * (64 << 10))
            socks.append(s)
        for _ in range(3):  # a control message of the largest size announced
            s = socket.create_connection((slow_tick.host, seg.port))
            s.sendall(wire.REQ.pack(wire.MAGIC, wire.VERSION, wire.OP_CONTROL, 0, 0, 1, 0, wire.MAX_CONTROL))
            socks.append(s)
        time.sleep(1.0)
        grown = slow_tick.rss_anon() - before
        print(f"9 stalled connections announcing 64 MiB (or the largest allowed) cost {grown / MiB:.1f} MiB")
        assert grown < 24 * MiB, f"9 stalled connections cost the server {grown / MiB:.1f} MiB"
        legit(slow_tick)
    finally:
        for s in socks:
            s.close()


# ---------------------------------------------------------------- reservations

def test_a_stalled_NodeWrite_is_cut_at_the_put_deadline_and_its_space_reclaimed(slow_tick):
    starter = RpcClient(slow_tick.address)  # the put is granted; its writer then stalls
    put_id = starter.call(m.PutStart(["hog"], [56 * MiB])).plans[0].put_id
    starter.close()
    attacker = socket.create_connection((slow_tick.host, slow_tick.port))
    try:
        attacker.sendall(rpc_frame(m.NodeWrite(["hog"], [56 * MiB], [put_id]), 56 * MiB) + b"\0" * MiB)
        time.sleep(0.3)
        with kvpool.connect(slow_tick.address, data_path="rpc") as client:
            with pytest.raises(KVPoolError):  # 56 of 64 MiB held by the stalled write: no room now
                client.put("victim-while-held", b"v" * (16 * MiB))
            held_for = 0.3 + closed_within(attacker, 10)
            assert held_for < 2 + 1.5, f"the reservation was held {held_for:.1f}s past a 2s put deadline"
            for i in range(3):  # its 56 MiB are back
                client.put(f"after-{i}", b"a" * (16 * MiB))
            assert client.get("after-2") == b"a" * (16 * MiB)
            assert client.get("hog") is None
    finally:
        attacker.close()
    assert "at its put deadline" in slow_tick.log_text()


# ---------------------------------------------------------------- timeouts and rate

def test_idle_connection_is_closed_at_the_idle_timeout(tight):
    with socket.create_connection((tight.host, tight.port)) as sock:
        sock.sendall(rpc_frame(m.Hello(PROTOCOL_VERSION, "idle")))
        waited = closed_within(sock, 6)
    assert 1.0 < waited < 4.0  # KVPOOL_IDLE_TIMEOUT_S=2, counted in 0.5 s ticks
    seg = tight.segment()
    with socket.create_connection((tight.host, seg.port)) as sock:  # the data port: same after a frame
        sock.sendall(wire.REQ.pack(wire.MAGIC, wire.VERSION, wire.OP_PING, 0, 0, 1, 0, 0))
        assert len(sock.recv(wire.RESP.size, socket.MSG_WAITALL)) == wire.RESP.size
        assert 1.0 < closed_within(sock, 6) < 4.0
    with socket.create_connection((tight.host, seg.port)) as sock:  # ... and a new one must speak at once
        assert closed_within(sock, 6) < 1.6


def test_a_started_header_must_finish_within_the_header_timeout(tight):
    seg = tight.segment()
    for port, partial in ((tight.port, HEADER.pack(PROTOCOL_VERSION, 0, 10, 0)[:5]),
                          (seg.port, wire.REQ.pack(wire.MAGIC, wire.VERSION, 4, 0, 0, 1, 0, 0)[:9])):
        with socket.create_connection((tight.host, port)) as sock:
            sock.sendall(partial)
            assert closed_within(sock, 5) < 1.6  # two 0.5 s ticks, and some slack
    legit(tight)


def test_a_body_below_the_minimum_rate_is_cut(tight):
    seg = tight.segment()
    starts = {
        "rpc message": (tight.port, HEADER.pack(PROTOCOL_VERSION, 0, 4 * MiB, 0)),
        "rpc payload": (tight.port, rpc_frame(m.NodeWrite(["slow"], [4 * MiB], [0]), 4 * MiB)),
        "data write": (seg.port, wire.REQ.pack(wire.MAGIC, wire.VERSION, wire.OP_WRITE, 0, seg.seg_id, 1, 0, 4 * MiB)),
    }
    for name, (port, start) in starts.items():
        cuts = tight.log_text().count("cut the connection from")
        with socket.create_connection((tight.host, port)) as sock:
            sock.sendall(start)
            t0 = time.monotonic()
            try:  # 8 KiB/s: far below KVPOOL_MIN_BODY_RATE=256KiB
                while time.monotonic() - t0 < 6:
                    sock.sendall(b"\0" * 1024)
                    time.sleep(0.125)
                raise AssertionError(f"{name}: a 8 KiB/s sender was not cut in 6 s")
            except (BrokenPipeError, ConnectionResetError):
                pass
            assert time.monotonic() - t0 < 4, name
        time.sleep(0.1)
        assert tight.log_text().count("cut the connection from") == cuts + 1, name  # cut for its pace, not a crash
    assert "too slowly" in tight.log_text() and "slower than min_body_rate" in tight.log_text()
    assert "Traceback" not in tight.log_text()
    legit(tight, 4 * MiB)


def test_pooled_connections_the_server_idle_closed_are_reopened(tight):
    with kvpool.connect(tight.address, data_path="engine", transports=["tcp"]) as client:
        client.put("pooled", b"p" * (1 * MiB))
        assert client.get("pooled") == b"p" * MiB
        time.sleep(2.8)  # past the 2 s idle timeout: the server closed the RPC and data connections
        assert client.get("pooled") == b"p" * MiB
        client.put("pooled-2", b"q" * 1000)
        assert client.get_batch(["pooled", "pooled-2"]) == [b"p" * MiB, b"q" * 1000]


# ---------------------------------------------------------------- connection caps

def _hello(sock: socket.socket) -> None:
    sock.sendall(rpc_frame(m.Hello(PROTOCOL_VERSION, "cap")))
    version, _, msg_len, payload_len = HEADER.unpack(sock.recv(HEADER.size, socket.MSG_WAITALL))
    sock.recv(msg_len, socket.MSG_WAITALL)


def test_connection_caps_per_peer_and_per_server_refuse_with_a_typed_error(tight):
    socks = []
    try:
        for _ in range(6):  # KVPOOL_MAX_CONNECTIONS_PER_PEER=6 from 127.0.0.1
            socks.append(connect_from(tight, tight.port))
            _hello(socks[-1])
        rpc = RpcClient(tight.address)
        with pytest.raises(LimitExceeded, match="max_conn.*per_peer"):
            rpc.call(m.Hello(PROTOCOL_VERSION, "seventh"))
        rpc.close()
        for _ in range(4):  # another address: up to KVPOOL_MAX_CONNECTIONS=10 in all
            socks.append(connect_from(tight, tight.port, "127.0.0.2"))
            _hello(socks[-1])
        over = connect_from(tight, tight.port, "127.0.0.3")
        over.sendall(rpc_frame(m.Hello(PROTOCOL_VERSION, "eleventh")))
        version, _, msg_len, _ = HEADER.unpack(over.recv(HEADER.size, socket.MSG_WAITALL))
        err = msgspec.msgpack.decode(over.recv(msg_len, socket.MSG_WAITALL), type=m.Err)
        assert err.code == "limit_exceeded" and "max_connections" in err.message
        over.close()
    finally:
        for s in socks:
            s.close()
    time.sleep(0.3)
    legit(tight)


def test_the_data_port_caps_connections_too(tight):
    seg = tight.segment()
    socks = []
    eng = TransferEngine(transports=["tcp"], timeout=5).start()
    try:
        for _ in range(6):
            s = connect_from(tight, seg.port)
            s.sendall(wire.REQ.pack(wire.MAGIC, wire.VERSION, wire.OP_PING, 0, 0, 1, 0, 0))
            s.recv(wire.RESP.size, socket.MSG_WAITALL)
            socks.append(s)
        with pytest.raises(TransferError) as info:
            eng.read(seg, 0, bytearray(4096))
        assert isinstance(info.value.failures.get(0, info.value), LimitReached)
        assert "max_connections_per_peer" in str(info.value)
    finally:
        for s in socks:
            s.close()
        time.sleep(0.3)
        eng.read(seg, 0, bytearray(4096))  # served again once the attacker's connections are gone
        eng.close()


# ---------------------------------------------------------------- clients cap replies

class LyingServer:
    """Answers every connection's first request with `reply`, then keeps it open."""

    def __init__(self, reply: bytes):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.reply = reply
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.recv(65536)
            conn.sendall(self.reply)
            self.held = conn

    def close(self) -> None:
        self.sock.close()


def test_the_rpc_client_refuses_a_reply_over_its_cap():
    body = encoder.encode(m.Ok())
    for payload_len, cap in ((8 << 30, None), (2 * MiB, MiB)):
        server = LyingServer(HEADER.pack(PROTOCOL_VERSION, 0, len(body), payload_len) + body)
        settings = Settings() if cap is None else Settings(max_reply_bytes=cap)
        rpc = RpcClient(f"127.0.0.1:{server.port}", timeout=3, settings=settings)
        try:
            with pytest.raises(LimitExceeded, match="max_reply_bytes"):
                rpc.call(m.NodeStats())
            assert not rpc.connected
        finally:
            rpc.close()
            server.close()


def test_the_transfer_client_refuses_replies_it_did_not_ask_for():
    from transfer import SegmentDescriptor

    cases = [wire.RESP.pack(wire.MAGIC, wire.VERSION, wire.OK, 0, 1, 64 * MiB),  # a READ reply larger than asked
             wire.RESP.pack(wire.MAGIC, wire.VERSION, wire.E_RANGE, 0, 1, 512 * MiB)]  # a huge error message
    for reply in cases:
        server = LyingServer(reply)
        desc = SegmentDescriptor("s", "liar", "127.0.0.1", server.port, 1 << 20, ("tcp",), seg_id=1)
        eng = TransferEngine(transports=["tcp"], timeout=3).start()
        try:
            with pytest.raises(TransferError) as info:
                eng.read(desc, 0, bytearray(4096))
            assert isinstance(info.value.__cause__ or info.value, ProtocolError) or "bytes" in str(info.value)
        finally:
            eng.close()
            server.close()
