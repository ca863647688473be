"""Races between a data-plane frame and the end of its grant (issue 27), replayed on a real
`kvpool serve` with a keyring and two tenants, the attacker's frames sent by hand on its own
authenticated transfer connection:

- write after abort: beta reserves a range, starts a WRITE frame under its grant, aborts the
  reservation, waits until acme's put lands at the same offset, then sends the rest of the frame;
- read after release: beta pins its own object, starts a READ frame it drains slowly (a tiny
  receive window), unpins and removes the object, waits until acme's put lands at the same
  offset, then drains the frame.

A grant is checked when a frame starts; what closes these races is that a range never goes back
to the allocator while a frame started under one of its grants still moves bytes (the abort and
the release cut such frames and wait for them). Each test asserts on acme's bytes: none of
beta's reach acme's object, and none of acme's reach beta.
"""

from __future__ import annotations

import mmap
import os
import socket
import time

import pytest

import kvpool
from kvpool.messages import Err, NodeCommit, NodePin, Slot
from kvpool.rpc import RpcClient
from pool_auth_support import SECRETS, cred, reserve, write_keyring
from served_support import Serve
from transfer import wire
from transfer.auth import client_handshake

MiB = 1 << 20


@pytest.fixture
def pool(tmp_path):
    served = Serve(tmp_path / "serve.log", write_keyring(tmp_path / "keyring.toml"), {},
                   "--dram-capacity", "64MiB")
    try:
        yield served
    finally:
        served.stop()


def transfer_conn(pool: Serve, who: str, rcvbuf: int = 0) -> socket.socket:
    """A raw connection to the node's data port, authenticated as `who`."""
    seg = pool.segment()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:  # before connect: the window the server sees is small from the start
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(10)
    sock.connect((pool.host, seg.port))
    client_handshake(sock, who, SECRETS[who].encode(), "transfer")
    return sock


def frame(opcode: int, seg_id: int, offset: int, length: int, grant: bytes) -> bytes:
    return wire.REQ.pack(wire.MAGIC, wire.VERSION, opcode, wire.FLAG_GRANT, seg_id, 7, offset, length) + grant


def recv_some(sock: socket.socket, n: int) -> bytes:
    """Up to `n` bytes: fewer when the server closed (or reset) the connection first."""
    out = bytearray()
    try:
        while len(out) < n:
            part = sock.recv(min(n - len(out), 1 << 16))
            if not part:
                break
            out += part
    except OSError:
        pass
    return bytes(out)


def offset_of(pool: Serve, who: str, key: str) -> int:
    rpc = RpcClient(pool.address, credential=cred(who))
    try:
        pins = rpc.call(NodePin([key], inline=False))
        assert pins.sizes[0] > 0, f"{key!r} is not stored"
        return pins.offsets[0]
    finally:
        rpc.close()  # the pin goes with the connection


def arena(pool: Serve) -> mmap.mmap:
    """The node's arena as a same-uid process maps it (only to watch the attacker's bytes land)."""
    path = pool.stats()["shm_path"]
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)


def wait_until(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_write_frame_cannot_land_in_a_range_reused_after_its_abort(pool):
    size, head = 4 * MiB, 600 << 10
    seg = pool.segment()
    theirs = b"B" * size
    rpc = RpcClient(pool.address, credential=cred("beta"))
    sock = transfer_conn(pool, "beta")
    view = arena(pool)
    try:
        slot = reserve(rpc, "mine", size)
        assert isinstance(slot, Slot) and slot.grant, slot
        sock.sendall(frame(wire.OP_WRITE, seg.seg_id, slot.offset, size, slot.grant) + theirs[:head])
        # the frame was admitted: its first bytes are in the reserved range
        wait_until(lambda: view[slot.offset + head - 4096:slot.offset + head] == theirs[:4096])
        aborted = rpc.call(NodeCommit(["mine"], [slot.put_id], [False])).results[0]
        assert isinstance(aborted, Err) and "aborted" in aborted.message
        ours = os.urandom(size)
        with kvpool.connect(pool.address, credential=cred("acme"), data_path="rpc") as acme:
            acme.put("victim", ours)
            assert offset_of(pool, "acme", "victim") == slot.offset  # the race is real: the range was reused
            try:  # the rest of the frame: refused or dropped, never written
                sock.sendall(theirs[head:])
            except OSError:
                pass
            recv_some(sock, wire.RESP.size)  # whatever the server answers (or the close) comes after the bytes
            got = acme.get("victim")
            assert got == ours, f"{sum(a != b for a, b in zip(got, ours))} bytes of acme's object were beta's"
    finally:
        view.close()
        sock.close()
        rpc.close()
    assert "cutting their connections" in pool.log_text()


def test_a_read_frame_cannot_carry_bytes_of_a_range_reused_after_its_release(pool):
    size, head = 24 * MiB, 64 << 10
    seg = pool.segment()
    theirs = b"B" * size
    with kvpool.connect(pool.address, credential=cred("beta"), data_path="rpc") as beta:
        beta.put("mine", theirs)
    rpc = RpcClient(pool.address, credential=cred("beta"))
    sock = transfer_conn(pool, "beta", rcvbuf=4096)
    try:
        pins = rpc.call(NodePin(["mine"], inline=False))
        offset, grant = pins.offsets[0], pins.grants[0]
        sock.sendall(frame(wire.OP_READ, seg.seg_id, offset, size, grant))
        hdr = recv_some(sock, wire.RESP.size)
        magic, _, status, _, _, length = wire.RESP.unpack(hdr)
        assert (magic, status, length) == (wire.MAGIC, wire.OK, size)  # the frame started: the grant was good
        got = recv_some(sock, head)
        rpc.call(NodePin([], [pins.pin_id]))  # unpin ...
        with kvpool.connect(pool.address, credential=cred("beta"), data_path="rpc") as beta:
            assert beta.remove("mine")  # ... and remove: the range is free
        ours = os.urandom(size)
        with kvpool.connect(pool.address, credential=cred("acme"), data_path="rpc") as acme:
            acme.put("victim", ours)
            assert offset_of(pool, "acme", "victim") == offset  # the race is real: the range was reused
            got += recv_some(sock, size - head)  # drain the frame
            assert acme.get("victim") == ours
        leaked = sum(1 for i in range(0, len(got), 4096) if got[i:i + 4096] == ours[i:i + 4096])
        assert got == theirs[:len(got)], f"{leaked} pages of acme's object reached beta ({len(got)} bytes read)"
    finally:
        sock.close()
        rpc.close()
    assert "cutting their connections" in pool.log_text()
