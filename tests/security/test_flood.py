"""A flood of unauthenticated connections against a real `kvpool serve` with a keyring (issue 27):
2,000 idle sockets, half on the pool RPC port and half on the transfer data port, from eight
loopback addresses (the tenant's among them) and reopened as soon as the server closes them,
must not lock out an authenticated tenant (before, 260 idle sockets from the tenant's address or
1,030 from several did: the caps counted connections before they authenticated).
Whoever is cut is told why in words that say so, never "server refused authentication".
Authenticated principals have their own budget (`max_connections_per_principal`)."""

from __future__ import annotations

import os
import resource
import select
import socket
import time

import msgspec
import pytest

import kvpool
from kvpool import messages as m
from kvpool.errors import LimitExceeded
from kvpool.rpc import RpcClient
from kvpool.rpc.frame import HEADER
from kvpool.tools.bench import flood_load
from pool_auth_support import cred, write_keyring
from served_support import Serve
from transfer import wire
from transfer.auth import LIMITED, MAGIC, client_handshake

FLOOD = 1000  # idle sockets per port: 2,000 in all
# The tenant connects from 127.0.0.1 too, which the flood uses for 300 of its sockets on each port
# (over the old per-peer cap of 256), and 100 from each of seven other addresses.
SOURCES = ["127.0.0.1"] * 3 + [f"127.0.0.{i}" for i in range(2, 9)]
UNAUTHENTICATED = "connection limit for unauthenticated peers reached"


@pytest.fixture(scope="module", autouse=True)
def _enough_descriptors():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4 * FLOOD + 1024
    if hard != resource.RLIM_INFINITY and hard < want:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {want}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("flood")
    served = Serve(tmp / "serve.log", write_keyring(tmp / "keyring.toml"), {}, "--dram-capacity", "64MiB")
    try:
        yield served
    finally:
        served.stop()


@pytest.fixture(scope="module")
def capped(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("flood-capped")
    served = Serve(tmp / "serve.log", write_keyring(tmp / "keyring.toml"),
                   {"KVPOOL_MAX_CONNECTIONS_PER_PRINCIPAL": "3", "KVPOOL_MAX_UNAUTHENTICATED_PER_PEER": "4",
                    "KVPOOL_MAX_UNAUTHENTICATED": "6",
                    "KVPOOL_HANDSHAKE_TIMEOUT_S": "2"}, "--dram-capacity", "16MiB")
    try:
        yield served
    finally:
        served.stop()


class Flood(flood_load.Flood):
    """`FLOOD` idle sockets per port from `SOURCES`, reopened as the server closes them, for a `with`."""

    def __init__(self, host: str, ports: list[int]):
        super().__init__(host, ports, FLOOD * len(ports), SOURCES)

    def __enter__(self) -> "Flood":
        self.start()
        assert self.up.wait(120), "the flood did not open its sockets in 120 s"
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def test_2000_idle_unauthenticated_sockets_do_not_lock_out_a_tenant(pool):
    seg = pool.segment()
    value = os.urandom(256 << 10)
    with Flood(pool.host, [pool.port, seg.port]) as flood:
        time.sleep(1.0)  # the server cuts them, the flood reopens them
        for round_ in range(3):
            for data_path in ("rpc", "engine"):  # the pool RPC port, then the transfer data port
                with kvpool.connect(pool.address, credential=cred("acme"), data_path=data_path,
                                    transports=["tcp"], timeout=10) as tenant:
                    tenant.put(f"tenant/{data_path}/{round_}", value)
                    assert tenant.get(f"tenant/{data_path}/{round_}") == value
        told = {port: list(t) for port, t in flood.told.items()}
        reopened = flood.reopened
    assert reopened > len(told) * FLOOD, f"the server closed only {reopened} of the flood's idle sockets"
    # what the cut sockets read: their protocol's refusal (an RPC Err, a data-port E_LIMIT), saying why
    for port, frames in told.items():
        assert frames and all(UNAUTHENTICATED.encode() in t or b"handshake_timeout_s" in t for t in frames), frames[:3]
    assert all(HEADER.unpack_from(t)[0] == m.PROTOCOL_VERSION for t in told[pool.port])  # an RPC Err frame
    assert all(wire.RESP.unpack_from(t)[:3] == (wire.MAGIC, wire.VERSION, wire.E_LIMIT) for t in told[seg.port])
    log = pool.log_text()
    assert "Traceback" not in log
    assert UNAUTHENTICATED in log


def _frame_err(sock: socket.socket) -> m.Err:
    sock.settimeout(5)
    _, _, msg_len, _ = HEADER.unpack(sock.recv(HEADER.size, socket.MSG_WAITALL))
    return msgspec.msgpack.decode(sock.recv(msg_len, socket.MSG_WAITALL), type=m.Err)


def test_idle_sockets_are_cut_before_one_in_its_handshake_and_each_is_told_why(capped):
    connect = lambda: socket.create_connection((capped.host, capped.port))  # noqa: E731
    # a peer that sends its hello and then stalls, never sending its proof
    stalled = connect()
    stalled.sendall(MAGIC + bytes([4]) + b"acme" + os.urandom(32))
    assert len(stalled.recv(65, socket.MSG_WAITALL)) == 65  # CHALL: it waits for DONE now
    idle = [connect() for _ in range(3)]  # KVPOOL_MAX_UNAUTHENTICATED_PER_PEER=4 from 127.0.0.1
    newer = [connect()]
    try:
        # over the cap: the oldest idle socket is cut (it said nothing), not the one authenticating;
        # it reads the RPC's own refusal frame
        err = _frame_err(idle[0])
        assert err.code == "limit_exceeded" and UNAUTHENTICATED in err.message
        # once every pending socket of the address has spoken, the oldest speaker goes: the stalled
        # peer reads, in place of DONE, the handshake's LIMITED answer with the reason
        for s in idle[1:] + newer:
            s.sendall(MAGIC[:1])
        time.sleep(0.3)
        newer.append(connect())
        stalled.settimeout(5)
        status, n = stalled.recv(2, socket.MSG_WAITALL)
        assert status == LIMITED
        assert UNAUTHENTICATED in stalled.recv(n, socket.MSG_WAITALL).decode()
        # a client whose hello meets such a refusal raises it as what it is, not "refused authentication"
        newer.append(connect())  # cuts newer[1], the only quiet one
        select.select([newer[1]], [], [], 5)
        rpc = RpcClient(capped.address, credential=cred("acme"))
        with pytest.raises(LimitExceeded, match=UNAUTHENTICATED) as info:
            rpc._authenticate(newer[1])
        assert "refused authentication" not in str(info.value)
    finally:
        stalled.close()
        for s in idle + newer:
            s.close()


def test_over_the_server_budget_the_oldest_idle_socket_of_any_address_is_cut(capped):
    socks = [socket.create_connection((capped.host, capped.port), source_address=(src, 0))
             for src in ["127.0.0.2"] * 3 + ["127.0.0.3"] * 3]  # KVPOOL_MAX_UNAUTHENTICATED=6
    try:
        socks.append(socket.create_connection((capped.host, capped.port), source_address=("127.0.0.4", 0)))
        err = _frame_err(socks[0])
        assert err.code == "limit_exceeded" and UNAUTHENTICATED in err.message and "(max_unauthenticated)" in err.message
        with kvpool.connect(capped.address, credential=cred("acme"), data_path="rpc", use_shm=False) as tenant:
            tenant.put("budget", b"b" * 100)  # its connection took the place of another idle one
            assert tenant.get("budget") == b"b" * 100
    finally:
        for s in socks:
            s.close()


def test_a_socket_that_does_not_authenticate_in_time_is_cut_and_told(capped):
    seg = capped.segment()
    for port in (capped.port, seg.port):
        with socket.create_connection((capped.host, port)) as sock:
            sock.settimeout(5)
            t0 = time.monotonic()
            data = sock.recv(4096)
            while True:
                more = sock.recv(4096)
                if not more:
                    break
                data += more
            assert time.monotonic() - t0 < 4  # KVPOOL_HANDSHAKE_TIMEOUT_S=2, not the 10 s header tick
            assert b"handshake_timeout_s" in data


def test_authenticated_principals_have_a_budget_of_their_own(capped):
    held = [RpcClient(capped.address, credential=cred("acme")) for _ in range(3)]
    try:
        for rpc in held:
            rpc.call(m.Hello(m.PROTOCOL_VERSION, "held"))
        extra = RpcClient(capped.address, credential=cred("acme"))
        with pytest.raises(LimitExceeded, match="max_connections_per_principal"):
            extra.call(m.Hello(m.PROTOCOL_VERSION, "fourth"))
        extra.close()
        other = RpcClient(capped.address, credential=cred("beta"))  # another tenant is not held up
        other.call(m.Hello(m.PROTOCOL_VERSION, "beta"))
        other.close()
        node = [RpcClient(capped.address, credential=cred("node")) for _ in range(5)]  # the pool's own: uncapped
        for rpc in node:
            rpc.call(m.Hello(m.PROTOCOL_VERSION, "node"))
        for rpc in node:
            rpc.close()
    finally:
        for rpc in held:
            rpc.close()
    # the data port too (there the engine's own principal, the node's, is not capped)
    seg = capped.segment()
    socks = []
    try:
        for _ in range(3):  # each pinged, so the server has counted it before the next comes
            socks.append(socket.create_connection((capped.host, seg.port)))
            client_handshake(socks[-1], "acme", cred("acme").secret, "transfer")
            socks[-1].sendall(wire.REQ.pack(wire.MAGIC, wire.VERSION, wire.OP_PING, 0, 0, 1, 0, 0))
            assert wire.RESP.unpack(socks[-1].recv(wire.RESP.size, socket.MSG_WAITALL))[2] == wire.OK
        over = socket.create_connection((capped.host, seg.port))
        socks.append(over)
        client_handshake(over, "acme", cred("acme").secret, "transfer")  # proved, then refused at the cap
        over.settimeout(5)
        _, _, status, _, req_id, length = wire.RESP.unpack(over.recv(wire.RESP.size, socket.MSG_WAITALL))
        assert (status, req_id) == (wire.E_LIMIT, 0)
        assert b"max_connections_per_principal" in over.recv(length, socket.MSG_WAITALL)
        for _ in range(4):
            socks.append(socket.create_connection((capped.host, seg.port)))
            client_handshake(socks[-1], "node", cred("node").secret, "transfer")
            socks[-1].sendall(wire.REQ.pack(wire.MAGIC, wire.VERSION, wire.OP_PING, 0, 0, 1, 0, 0))
            assert wire.RESP.unpack(socks[-1].recv(wire.RESP.size, socket.MSG_WAITALL))[2] == wire.OK
    finally:
        for s in socks:
            s.close()
