"""Attacks on the transfer engine's data port of a real `kvpool serve` (issue 13): raw READ and
WRITE at any offset of the DRAM arena, without authentication, without a grant, with forged,
expired, other-op, other-segment and out-of-range grants. Each must fail cleanly with nothing
moved, while the legitimate engine-path client (pin/reserve grants) is still served; with
authentication off the legitimate paths work as before. RDMA over the fake verbs layer: the
arena is registered read-only when grants are required."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import pytest

import kvpool
from kvpool.security.keyring import grant_key
from kvpool import messages as m
from kvpool.messages import NodePin
from kvpool.rpc import RpcClient
from pool_auth_support import SECRETS, cred, reserve, write_keyring
from served_support import Serve
from transfer import READ, WRITE, Op, TransferEngine, TransferError, wire
from transfer.errors import AccessDenied, InvalidOp
from transfer.grant import GRANT, Grants, fields

VALUE = bytes(range(256)) * 256  # 64 KiB the victim stores


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("data-plane")
    served = Serve(tmp / "serve.log", write_keyring(tmp / "keyring.toml"), {"KVPOOL_LEASE_S": "2"},
                   "--dram-capacity", "32MiB")
    try:
        with kvpool.connect(served.address, credential=cred("acme"), data_path="rpc") as victim:
            victim.put("victim", VALUE)
        yield served
    finally:
        while HOLDERS:
            HOLDERS.pop().close()
        served.stop()


@pytest.fixture(scope="module")
def open_pool(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("data-plane-open")
    served = Serve(tmp / "serve.log", None, {"KVPOOL_LOCAL_AUTH": "off"}, "--dram-capacity", "32MiB")
    try:
        yield served
    finally:
        served.stop()


# The owner's connections: closing one releases its pins (and revokes their grants).
HOLDERS: list[RpcClient] = []


def victim_pin(pool: Serve) -> tuple[int, int, bytes]:
    """(offset, size, READ grant) of the victim's object, as the node hands them to its owner,
    who keeps the pin (until its 2 s lease ends)."""
    rpc = RpcClient(pool.address, credential=cred("acme"))
    HOLDERS.append(rpc)
    pins = rpc.call(NodePin(["victim"], inline=False))
    return pins.offsets[0], pins.sizes[0], pins.grants[0]


def victim_intact(pool: Serve) -> None:
    with kvpool.connect(pool.address, credential=cred("acme"), data_path="rpc") as victim:
        assert victim.get("victim") == VALUE


def engine(who: str | None) -> TransferEngine:
    return TransferEngine(transports=["tcp"], timeout=5,
                          credential=(who, SECRETS[who].encode()) if who else None).start()


def attempt(eng: TransferEngine, opcode: int, seg, offset: int, length: int, grant: bytes | None) -> TransferError:
    buf = bytearray(b"\xee" * length)
    with pytest.raises(TransferError) as info:
        (eng.read if opcode == READ else eng.write)(seg, offset, buf, 0, length, None, grant)
    if opcode == READ:
        assert buf == b"\xee" * length  # nothing arrived
    return info.value


# ---------------------------------------------------------------- the legitimate client

@pytest.mark.parametrize("size", [64 << 10, 3 << 20])
def test_engine_path_with_grants_serves_the_owner(pool, size):
    value = os.urandom(size)
    with kvpool.connect(pool.address, credential=cred("acme"), data_path="engine", transports=["tcp"]) as client:
        client.put(f"legit-{size}", value)
        assert client.get(f"legit-{size}") == value
        assert client.get_batch([f"legit-{size}", "victim"]) == [value, VALUE]
        assert client.get("no-such-key") is None


def test_the_node_hands_out_grants_for_exactly_what_it_pins_and_reserves(pool):
    offset, size, grant = victim_pin(pool)
    op, seg_id, g_off, g_len, expires = fields(grant)
    assert (op, g_off, g_len) == (READ, offset, size) and seg_id == pool.segment().seg_id
    assert 0 < expires / 1000 - time.time() <= 2.5  # the pin's lease (KVPOOL_LEASE_S=2)
    rpc = RpcClient(pool.address, credential=cred("acme"))
    try:
        slot = reserve(rpc, "reserved", 4096)
        op, _, g_off, g_len, _ = fields(slot.grant)
        assert (op, g_off, g_len) == (WRITE, slot.offset, 4096)
    finally:
        rpc.close()  # the reservation is aborted with its connection


# ---------------------------------------------------------------- attacks

def test_raw_frames_without_the_handshake_are_refused(pool):
    seg = pool.segment()
    offset, size, _ = victim_pin(pool)
    for opcode, payload in ((wire.OP_READ, b""), (wire.OP_WRITE, b"\0" * size)):
        with socket.create_connection((pool.host, seg.port), timeout=5) as sock:
            hdr = wire.REQ.pack(wire.MAGIC, wire.VERSION, opcode, 0, seg.seg_id, 7, offset, size)
            sock.sendall(hdr + payload)
            got = b""
            while part := sock.recv(1 << 20):
                got += part
        magic, _, status, _, req_id, length = wire.RESP.unpack_from(got)
        assert (magic, status, req_id) == (wire.MAGIC, wire.E_UNAUTHORIZED, 7)
        assert b"credential" in got[wire.RESP.size:] and len(got) == wire.RESP.size + length  # no arena bytes
    err = attempt(engine(None), READ, seg, offset, size, None)
    assert isinstance(err.failures[0] if err.failures else err, AccessDenied)
    victim_intact(pool)


def test_wrong_secret_is_refused(pool):
    offset, size, _ = victim_pin(pool)
    eng = TransferEngine(transports=["tcp"], timeout=5, credential=("acme", b"x" * 40)).start()
    try:
        err = attempt(eng, READ, pool.segment(), offset, size, None)
        assert "proof is wrong" in str(err)
    finally:
        eng.close()


@pytest.mark.parametrize("opcode", [READ, WRITE])
def test_authenticated_peer_without_a_grant_moves_nothing(pool, opcode):
    seg = pool.segment()
    offset, size, _ = victim_pin(pool)
    eng = engine("beta")  # another tenant: it proves who it is, but holds no grant
    try:
        for off, n in ((offset, size), (0, seg.size), (seg.size - 4096, 4096)):
            err = attempt(eng, opcode, seg, off, n, None)
            assert "no grant" in str(err)
    finally:
        eng.close()
    victim_intact(pool)


def _forge(grant: bytes, **changes) -> bytes:
    parts = dict(zip(("op", "serial", "seg", "offset", "length", "expires", "mac"), GRANT.unpack(grant)))
    parts.update(changes)
    return GRANT.pack(*parts.values())


def test_forged_and_altered_grants_are_refused(pool):
    seg = pool.segment()
    offset, size, grant = victim_pin(pool)
    eng = engine("beta")
    try:
        mac = GRANT.unpack(grant)[6]
        cases = {
            "flipped mac": (READ, offset, size, _forge(grant, mac=bytes([mac[0] ^ 1]) + mac[1:])),
            "widened range": (READ, 0, seg.size, _forge(grant, offset=0, length=seg.size)),
            "turned into a WRITE": (WRITE, offset, size, _forge(grant, op=WRITE)),
            "extended expiry": (READ, offset, size, _forge(grant, expires=fields(grant)[4] + 3_600_000)),
            "signed with another key": (READ, offset, size,
                                        Grants(b"k" * 32, seg.engine).sign(READ, seg.seg_id, offset, size, 60)),
            "garbage": (READ, offset, size, os.urandom(48)),
        }
        for name, (opcode, off, n, bad) in cases.items():
            err = attempt(eng, opcode, seg, off, n, bad)
            assert "signature" in str(err), name
    finally:
        eng.close()
    victim_intact(pool)


def test_a_valid_grant_covers_only_its_op_range_segment_and_time(pool):
    seg = pool.segment()
    offset, size, grant = victim_pin(pool)
    # What the node would sign (the test holds the keyring): each grant is genuine, yet does not cover the op.
    signer = Grants(grant_key(SECRETS["node"].encode()), seg.engine)
    eng = engine("acme")
    try:
        assert "outside the granted" in str(attempt(eng, READ, seg, offset, size + 4096, grant))
        assert "outside the granted" in str(attempt(eng, READ, seg, offset + 4096, size, grant))
        assert "READ grant does not allow a WRITE" in str(attempt(eng, WRITE, seg, offset, size, grant))
        expired = signer.sign(READ, seg.seg_id, offset, size, -1, "acme")
        assert "expired" in str(attempt(eng, READ, seg, offset, size, expired))
        other_seg = signer.sign(READ, seg.seg_id + 1, offset, size, 60, "acme")
        assert "segment" in str(attempt(eng, READ, seg, offset, size, other_seg))
        other_engine = Grants(grant_key(SECRETS["node"].encode()), "kvpool-elsewhere").sign(
            READ, seg.seg_id, offset, size, 60, "acme")
        assert "signature" in str(attempt(eng, READ, seg, offset, size, other_engine))
        unbound = signer.sign(READ, seg.seg_id, offset, size, 60)  # the node's key, but to no principal
        assert "signature is not valid for principal 'acme'" in str(attempt(eng, READ, seg, offset, size, unbound))
        # ... while the genuine grant reads exactly the pinned bytes.
        buf = bytearray(size)
        eng.read(seg, offset, buf, 0, size, None, grant)
        assert bytes(buf) == VALUE
    finally:
        eng.close()
    victim_intact(pool)


def test_a_grant_works_only_on_a_connection_of_the_principal_it_was_issued_to(pool):
    """Grants are no bearer tokens: beta, authenticated as itself, presents acme's genuine grants
    (a READ of acme's pinned object, a WRITE of acme's reservation) and moves nothing; acme's own
    connection is served with the same grants."""
    seg = pool.segment()
    offset, size, grant = victim_pin(pool)
    rpc = RpcClient(pool.address, credential=cred("acme"))
    thief, owner = engine("beta"), engine("acme")
    try:
        slot = reserve(rpc, "bound-w", 4096)
        for opcode, off, n, stolen in ((READ, offset, size, grant), (WRITE, slot.offset, 4096, slot.grant)):
            err = attempt(thief, opcode, seg, off, n, stolen)
            assert "signature is not valid for principal 'beta'" in str(err)
        buf = bytearray(size)
        owner.read(seg, offset, buf, 0, size, None, grant)
        assert bytes(buf) == VALUE
        owner.write(seg, slot.offset, bytearray(b"o" * 4096), 0, 4096, None, slot.grant)
        assert isinstance(rpc.call(m.NodeCommit(["bound-w"], [slot.put_id], [True])).results[0], m.Placed)
    finally:
        thief.close()
        owner.close()
        rpc.close()
    with kvpool.connect(pool.address, credential=cred("acme"), data_path="rpc") as client:
        assert client.get("bound-w") == b"o" * 4096
    victim_intact(pool)


def test_a_pin_grant_expires_with_the_pin_lease(pool):
    seg = pool.segment()
    offset, size, grant = victim_pin(pool)
    time.sleep(max(0.0, fields(grant)[4] / 1000 - time.time()) + 0.2)
    eng = engine("acme")
    try:
        assert "expired" in str(attempt(eng, READ, seg, offset, size, grant))
    finally:
        eng.close()


def test_a_grant_is_revoked_when_its_pin_is_released_or_its_reservation_ends(pool):
    seg = pool.segment()
    rpc = RpcClient(pool.address, credential=cred("acme"))
    eng = engine("acme")
    try:
        pins = rpc.call(NodePin(["victim"], inline=False))
        offset, size, grant = pins.offsets[0], pins.sizes[0], pins.grants[0]
        buf = bytearray(size)
        eng.read(seg, offset, buf, 0, size, None, grant)  # while pinned: served
        rpc.call(NodePin([], [pins.pin_id]))  # released: the range may now be evicted and reused
        assert "revoked" in str(attempt(eng, READ, seg, offset, size, grant))
        again = rpc.call(NodePin(["victim"], inline=False))  # a new pin of the same range: a new grant
        assert again.offsets[0] == offset and again.grants[0] != grant
        eng.read(seg, offset, buf, 0, size, None, again.grants[0])
        assert bytes(buf) == VALUE
        # a reservation's WRITE grant ends with its commit: no writing into a published object
        slot = reserve(rpc, "revoked-w", 4096)
        eng.write(seg, slot.offset, bytearray(b"w" * 4096), 0, 4096, None, slot.grant)
        assert isinstance(rpc.call(m.NodeCommit(["revoked-w"], [slot.put_id], [True])).results[0], m.Placed)
        assert "revoked" in str(attempt(eng, WRITE, seg, slot.offset, 4096, slot.grant))
    finally:
        eng.close()
        rpc.close()
    with kvpool.connect(pool.address, credential=cred("acme"), data_path="rpc") as client:
        assert client.get("revoked-w") == b"w" * 4096
    victim_intact(pool)


def test_the_refusals_are_logged(pool):
    text = pool.log_text()
    assert "no authentication hello" in text and "no grant" in text and "expired" in text


# ---------------------------------------------------------------- authentication off: as before

def test_with_authentication_off_the_data_paths_work_as_before(open_pool, monkeypatch):
    monkeypatch.setenv("KVPOOL_LOCAL_AUTH", "off")  # no keyring, not even the user's own
    value = os.urandom(1 << 20)
    for path in ("engine", "rpc"):
        with kvpool.connect(open_pool.address, data_path=path, transports=["tcp"]) as client:
            client.put(f"open-{path}", value)
            assert client.get(f"open-{path}") == value
    rpc = RpcClient(open_pool.address)
    try:
        pins = rpc.call(NodePin(["open-engine"], inline=False))
        assert pins.grants == []  # no grants are signed, none are needed
    finally:
        rpc.close()
    eng = engine(None)
    try:  # authentication off (trusted loopback): a raw READ of the arena is served
        buf = bytearray(1 << 20)
        eng.read(open_pool.segment(), pins.offsets[0], buf)
        assert bytes(buf) == value
    finally:
        eng.close()


# ---------------------------------------------------------------- RDMA (fake verbs: no RDMA device here)

def test_rdma_registration_is_read_only_when_grants_are_required():
    sys.path.insert(0, str(Path(__file__).parents[1] / "transfer"))
    from fake_verbs import FakeDevice, FakeFabric

    fabric = FakeFabric()
    key = b"g" * 32
    owner = TransferEngine(name="owner", transports=["tcp", "rdma"], rdma_device=FakeDevice(fabric, "a"),
                           grant_key=key).start()
    peer = TransferEngine(name="peer", transports=["tcp", "rdma"], rdma_device=FakeDevice(fabric, "b")).start()
    try:
        arena = bytearray(b"A" * 65536)
        seg = owner.register(arena, name="arena")
        assert seg.rdma is not None and seg.rdma.writable is False
        with pytest.raises(InvalidOp, match="read-only"):
            peer.write(seg, 0, bytearray(4096), transport="rdma")
        # an RDMA WRITE is never posted: a WRITE goes over tcp, where its grant is checked
        with pytest.raises(TransferError, match="no grant"):
            peer.submit([Op(WRITE, bytearray(4096), 0, seg, 0, 4096)]).wait(10)
        grant = owner.signer("arena")(WRITE, 0, 4096, 30)
        peer.submit([Op(WRITE, bytearray(b"B" * 4096), 0, seg, 0, 4096, grant)]).wait(10)
        assert arena[:4096] == b"B" * 4096 and arena[4096:8192] == b"A" * 4096
        # a one-sided write straight at the rkey (what a rogue peer would post) fails at the NIC
        out = bytearray(4096)
        peer.read(seg, 4096, out, transport="rdma")  # READ: still allowed, not grant-checked (documented)
        assert out == b"A" * 4096
        assert fabric.mrs[seg.rdma.rkey].remote_write is False
    finally:
        peer.close()
        owner.close()
