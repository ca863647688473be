"""Attacks on the pool RPC of a real `kvpool serve` with a keyring (issue 13): who may connect,
and what each principal may send. Tenant isolation is `test_tenants.py`."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

import kvpool
from kvpool import messages as m
from kvpool.errors import Forbidden, Unauthorized
from kvpool.messages import PROTOCOL_VERSION
from kvpool.rpc import RpcClient
from kvpool.rpc.frame import HEADER, frame
from pool_auth_support import clean_env, cred, write_keyring
from served_support import Serve


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pool-rpc-auth")
    served = Serve(tmp / "serve.log", write_keyring(tmp / "keyring.toml"), None, "--dram-capacity", "32MiB")
    try:
        yield served
    finally:
        served.stop()


def _legit_roundtrip(pool: Serve, who: str = "acme") -> None:
    with kvpool.connect(pool.address, credential=cred(who)) as client:
        value = os.urandom(70_000)
        key = f"legit/{value[:6].hex()}"
        client.put(key, value)
        assert client.get(key) == value


def _raw_exchange(pool: Serve, msg) -> bytes:
    """Send one frame with no handshake; everything the server sends back before it closes."""
    with socket.create_connection((pool.host, pool.port), timeout=5) as sock:
        sock.sendall(b"".join(bytes(p) for p in frame(msg, 0)))
        out = b""
        while True:
            part = sock.recv(65536)
            if not part:
                return out
            out += part


@pytest.mark.parametrize("msg", [
    m.Admin("keys", {}),                                   # list everything
    m.NodeGet(["some-key"]),                               # read anything
    m.Remove(["some-key"]),                                # delete anything
    m.NodeRemove(["some-key"], [0]),                       # delete with the (former) wildcard put id
    m.Lookup(["some-key"], lease=True),                    # lease everything
    m.NodePin(["some-key"], inline=False),                 # pin everything
    m.Hello(PROTOCOL_VERSION, "attacker"),
], ids=lambda msg: type(msg).__name__)
def test_unauthenticated_requests_are_refused_with_how_to(pool, msg):
    raw = _raw_exchange(pool, msg)
    version, _, msg_len, payload_len = HEADER.unpack_from(raw)
    reply = msgspec.msgpack.decode(raw[HEADER.size:HEADER.size + msg_len], type=m.Err)
    assert reply.code == "unauthorized"
    assert "KVPOOL_AUTH_FILE" in reply.message and "KVPOOL_PRINCIPAL" in reply.message
    assert len(raw) == HEADER.size + msg_len  # nothing else, then the server closed
    # The SDK says the same as a typed error.
    rpc = RpcClient(pool.address, credential=None)
    try:
        with pytest.raises(Unauthorized, match="KVPOOL_AUTH_FILE"):
            rpc.call(msg)
    finally:
        rpc.close()
    _legit_roundtrip(pool)


@pytest.mark.parametrize("who,secret", [("acme", "x" * 40), ("node", "a" * 40), ("nobody", "a" * 40)])
def test_wrong_secret_or_unknown_principal_is_refused(pool, who, secret):
    with pytest.raises(Unauthorized, match="proof is wrong|wrong secret"):
        kvpool.connect(pool.address, credential=cred(who, secret))
    rpc = RpcClient(pool.address, credential=cred(who, secret))
    try:
        with pytest.raises(Unauthorized):
            rpc.call(m.Admin("keys", {}))
    finally:
        rpc.close()
    _legit_roundtrip(pool)


def test_credential_from_environment_and_unix_socket(pool, tmp_path, monkeypatch):
    keyring = write_keyring(tmp_path / "mine.toml")
    monkeypatch.setenv("KVPOOL_AUTH_FILE", str(keyring))
    monkeypatch.setenv("KVPOOL_PRINCIPAL", "beta")
    with kvpool.connect(pool.address) as client:
        assert client.credential.principal == "beta" and client.scope == "beta\x00"
        client.put("env/key", b"v" * 100)
        assert client.get("env/key") == b"v" * 100
        master = client._master
        if master.unix is not None:  # same host: the handshake also ran on the unix socket
            assert master.connected


def test_unix_socket_needs_the_handshake_too(pool):
    rpc = RpcClient(pool.address, credential=cred("node"))
    try:
        hello = rpc.call(m.Hello(PROTOCOL_VERSION, "t"))
    finally:
        rpc.close()
    if not hello.unix:
        pytest.skip("no unix socket on this platform")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect("\0" + hello.unix[1:])
    sock.sendall(b"".join(bytes(p) for p in frame(m.Admin("keys", {}), 0)))
    raw = b""
    while part := sock.recv(65536):
        raw += part
    sock.close()
    _, _, msg_len, _ = HEADER.unpack_from(raw)
    assert msgspec.msgpack.decode(raw[HEADER.size:HEADER.size + msg_len], type=m.Err).code == "unauthorized"
    # With the handshake, the unix socket serves.
    rpc = RpcClient(pool.address, credential=cred("acme"))
    try:
        assert rpc.use_unix(hello.unix)
        assert rpc.call(m.Exists(["x"])).values == [False]
    finally:
        rpc.close()


NODE_ONLY = [
    m.RegisterNode(m.NodeInfo("evil", "127.0.0.1:1", "h", [], None, {"dram": 1 << 30}), []),
    m.Heartbeat("whatever", {}, dropped=[m.Held("k", 1, "dram", 0)]),
    m.NodeCopy(["k"], [1], "127.0.0.1:22"),
    m.NodeRemove(["k"], [0]),
]


@pytest.mark.parametrize("who", ["acme", "ops"])
@pytest.mark.parametrize("msg", NODE_ONLY, ids=lambda msg: type(msg).__name__)
def test_node_only_messages_are_forbidden_to_tenants_and_admins(pool, who, msg):
    rpc = RpcClient(pool.address, credential=cred(who))
    try:
        with pytest.raises(Forbidden, match="takes a node principal"):
            rpc.call(msg)
        assert rpc.call(m.Exists(["k"])).values == [False]  # the connection still serves
    finally:
        rpc.close()


@pytest.mark.parametrize("method", ["nodes", "stats", "config"])
def test_whole_pool_admin_views_are_forbidden_to_a_tenant(pool, method):
    with kvpool.connect(pool.address, credential=cred("acme")) as client:
        with pytest.raises(Forbidden):
            client.admin(method)
    with kvpool.connect(pool.address, credential=cred("ops")) as admin:
        assert admin.admin(method) is not None


def test_wildcard_put_id_removes_nothing(pool):
    with kvpool.connect(pool.address, credential=cred("acme")) as client:
        client.put("precious", b"p" * 1000)
        rpc = RpcClient(pool.address, credential=cred("node"))  # even the node role
        try:
            assert rpc.call(m.NodeRemove(["acme\x00precious"], [0])).values == [False]
            assert rpc.call(m.NodeRemove(["acme\x00precious"], [987654321])).values == [False]
        finally:
            rpc.close()
        assert client.get("precious") == b"p" * 1000


def test_pins_are_released_only_by_their_connection(pool):
    with kvpool.connect(pool.address, credential=cred("acme")) as client:
        client.put("pinned", b"q" * 100_000)
    owner = RpcClient(pool.address, credential=cred("acme"))
    other = RpcClient(pool.address, credential=cred("beta"))
    node = RpcClient(pool.address, credential=cred("node"))
    try:
        pin = owner.call(m.NodePin(["pinned"], inline=False))
        assert pin.pin_id and pin.sizes == [100_000]
        before = node.call(m.NodeStats()).doc["total"]["pinned"]
        assert before >= 1
        other.call(m.NodePin([], unpin=[pin.pin_id]))  # someone else's pin id: ignored
        other.send_oneway(m.NodeUnpin([pin.pin_id]))
        assert other.call(m.Exists(["x"])).values == [False]
        assert node.call(m.NodeStats()).doc["total"]["pinned"] == before
        # the owner's own unpin works, and the object can then be removed at once
        owner.call(m.NodePin([], unpin=[pin.pin_id]))
    finally:
        for rpc in (owner, other, node):
            rpc.close()
    with kvpool.connect(pool.address, credential=cred("acme")) as client:
        assert client.remove("pinned")
        assert client.get("pinned") is None


def test_protected_mode_refuses_a_public_address_without_a_keyring(tmp_path):
    for command in ("serve", "master", "node"):
        extra = ["--master", "127.0.0.1:1"] if command == "node" else []
        proc = subprocess.run([str(Path(sys.executable).with_name("kvpool")), command, "--host", "0.0.0.0",
                               "--port", "0", *extra], capture_output=True, text=True, timeout=60, env=clean_env())
        assert proc.returncode != 0
        assert "protected mode" in proc.stderr and "KVPOOL_AUTH_FILE" in proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr


def test_a_tenant_cannot_end_another_tenants_lease(pool):
    with kvpool.connect(pool.address, credential=cred("beta")) as beta:
        beta.put("lease/k", b"l" * 1000)
    holder = RpcClient(pool.address, credential=cred("beta"))
    thief = RpcClient(pool.address, credential=cred("acme"))
    try:
        lease_id = holder.call(m.Lookup(["lease/k"])).lease_id
        assert lease_id
        thief.send_oneway(m.Release([lease_id]))
        thief.call(m.Lookup(["x"], release=[lease_id]))
        with kvpool.connect(pool.address, credential=cred("ops")) as ops:
            assert ops.admin("key_info", key="beta\x00lease/k")["lease"]["active"] is True
            holder.call(m.Lookup([], release=[lease_id]))  # its holder ends it
            assert ops.admin("key_info", key="beta\x00lease/k")["lease"]["active"] is False
    finally:
        holder.close()
        thief.close()


CHILD = """
import os, socket, sys
os.setuid(65534)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(5)
s.connect("\\0" + sys.argv[1])  # an abstract socket
data = b""
while True:
    part = s.recv(65536)
    if not part:
        break
    data += part
sys.stdout.write(data.hex())
"""


def test_unix_socket_refuses_another_uid(pool):
    if os.getuid() != 0:
        pytest.skip("needs root to connect as another uid")
    rpc = RpcClient(pool.address, credential=cred("node"))
    try:
        unix = rpc.call(m.Hello(PROTOCOL_VERSION, "t")).unix
    finally:
        rpc.close()
    if not unix:
        pytest.skip("no unix socket on this platform")
    out = subprocess.run([sys.executable, "-I", "-c", CHILD, unix[1:]], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    raw = bytes.fromhex(out.stdout)
    _, _, msg_len, _ = HEADER.unpack_from(raw)
    err = msgspec.msgpack.decode(raw[HEADER.size:HEADER.size + msg_len], type=m.Err)
    assert err.code == "unauthorized" and "uid" in err.message
    _legit_roundtrip(pool)
