"""The RDMA transport's logic over the FAKE verbs layer (fake_verbs.py), plus real-device tests.

The fake runs two engines in one process: the QP handshake goes over the real TCP control
channel, one-sided ops are memmoves checked against registered regions. What is tested here
is transfer/rdma.py (slicing, QP spreading, backlog, completions, timeouts, broken peers);
transfer/verbs.py itself runs only where pyverbs finds a device.
"""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from fake_verbs import FakeDevice, FakeFabric
from transfer import READ, WRITE, Op, TransferEngine, TransferError, TransferTimeout, rdma
from transfer.verbs import unavailable_reason

TIMEOUT = 1.0


@pytest.fixture
def fabric():
    return FakeFabric()


@pytest.fixture
def engines(fabric):
    made = []

    def make(**kw):
        kw.setdefault("timeout", TIMEOUT)
        eng = TransferEngine(transports=["tcp", "rdma"], rdma_device=FakeDevice(fabric), **kw).start()
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.close()


def test_handshake_slicing_and_bit_exact(engines, fabric):
    server = engines()
    client = engines(slice_bytes=64 << 10, connections_per_peer=3)
    remote = np.random.default_rng(3).integers(0, 256, 4 << 20, dtype=np.uint8)
    seg = server.register(remote)
    assert seg.rdma is not None and "rdma" in seg.transports
    assert client.choose(seg) == "rdma"

    rng = random.Random(5)
    ops, outs = [], []
    for size in (1, 100, 4096, 65536, (64 << 10) + 1, 1 << 20):
        off = rng.randrange(0, len(remote) - size)
        out = bytearray(size)
        ops.append(Op(READ, out, 0, seg, off, size))
        outs.append((out, off))
    client.submit(ops).wait(5)
    for out, off in outs:
        assert out == remote[off:off + len(out)].tobytes()

    payload = np.frombuffer(rng.randbytes(300_000), dtype=np.uint8)
    client.write(seg, 12345, payload)
    assert np.array_equal(remote[12345:12345 + len(payload)], payload)

    client_qps = [qpn for qpn, n in fabric.posts.items() if n]
    assert len(client_qps) == 3  # slices were spread over every QP of the peer


def test_registered_local_buffer_uses_its_mr_and_temporary_mrs_are_released(engines, fabric):
    server = engines()
    client = engines()
    seg = server.register(bytearray(b"r" * 65536))
    local = bytearray(65536)
    client.register(local, name="landing")
    mrs_before = len(fabric.mrs)
    client.read(seg, 0, local)
    assert local == b"r" * 65536
    assert len(fabric.mrs) == mrs_before  # no temporary registration for a registered buffer
    scratch = bytearray(1000)
    client.read(seg, 0, scratch)
    assert scratch == b"r" * 1000
    assert len(fabric.mrs) == mrs_before  # the temporary MR is gone once the op is done


def test_backlog_beyond_queue_depth(engines, monkeypatch):
    monkeypatch.setattr(rdma, "MAX_OUTSTANDING", 2)
    server = engines()
    client = engines(slice_bytes=1024, connections_per_peer=2)
    data = bytes(range(256)) * 1024
    seg = server.register(bytearray(data))
    out = bytearray(len(data))
    client.submit([Op(READ, out, 0, seg, 0, len(data))]).wait(5)  # 256 slices through 2x2 slots
    assert out == data


def test_error_completion_fails_ops_and_peer_reconnects(engines, fabric):
    server = engines()
    client = engines()
    seg = server.register(bytearray(b"e" * 4096))
    client.read(seg, 0, bytearray(10))
    fabric.fail_with = "IBV_WC_RETRY_EXC_ERR"
    with pytest.raises(TransferError, match="RETRY_EXC_ERR"):
        client.submit([Op(READ, bytearray(100), 0, seg, 0, 100)] * 3).wait(5)
    fabric.fail_with = None
    out = bytearray(100)
    client.read(seg, 0, out)  # new QPs after the broken ones were closed
    assert out == b"e" * 100


def test_remote_access_outside_mr_is_an_error_not_corruption(engines):
    server = engines()
    client = engines()
    seg = server.register(bytearray(4096))
    liar = seg.__class__(**{**{f: getattr(seg, f) for f in seg.__struct_fields__}, "size": 8192})
    with pytest.raises(TransferError, match="REM_ACCESS_ERR"):
        client.read(liar, 4096, bytearray(100))


def test_silent_peer_times_out_within_timeout(engines, fabric):
    server = engines()
    client = engines()
    seg = server.register(bytearray(1 << 20))
    client.read(seg, 0, bytearray(10))
    fabric.silent.add(server._transports["rdma"].dev)
    start = time.monotonic()
    batch = client.submit([Op(WRITE, b"z" * 1000, 0, seg, i * 1000, 1000) for i in range(5)])
    with pytest.raises(TransferTimeout) as info:
        batch.wait(TIMEOUT * 5)
    assert set(info.value.failures) == set(range(5))
    assert time.monotonic() - start < TIMEOUT * 2


def test_peer_without_rdma_is_reached_over_tcp(engines):
    server = TransferEngine(transports=["tcp"], timeout=TIMEOUT).start()
    try:
        client = engines()
        seg = server.register(bytearray(b"t" * 100))
        assert seg.rdma is None and client.choose(seg) == "tcp"
        out = bytearray(100)
        client.read(seg, 0, out)
        assert out == b"t" * 100
    finally:
        server.close()


def test_rdma_handshake_refused_by_peer_without_rdma(engines):
    """A descriptor claiming rdma for an engine that has none: typed error, no hang."""
    server = TransferEngine(transports=["tcp"], timeout=TIMEOUT).start()
    try:
        client = engines()
        seg = server.register(bytearray(100))
        from transfer.descriptor import RdmaEndpoint

        forged = seg.__class__(**{**{f: getattr(seg, f) for f in seg.__struct_fields__},
                                  "transports": ("rdma", "tcp"), "rdma": RdmaEndpoint(addr=1, rkey=1)})
        with pytest.raises(TransferError, match="rdma"):
            client.read(forged, 0, bytearray(10), transport="rdma")
    finally:
        server.close()


_REASON = unavailable_reason()


@pytest.mark.rdma
@pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
def test_real_device_loopback():
    """Two engines on the real device of this machine (runs only where pyverbs finds one)."""
    with TransferEngine(transports=["rdma", "tcp"]) as server, TransferEngine(transports=["rdma", "tcp"]) as client:
        data = bytearray(np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8).tobytes())
        seg = server.register(data)
        assert client.choose(seg) == "rdma"
        out = bytearray(len(data))
        client.read(seg, 0, out)
        assert out == data
        client.write(seg, 0, b"\x00" * 4096)
        assert data[:4096] == b"\x00" * 4096


def test_busy_peer_does_not_keep_a_silent_one_from_timing_out(engines, fabric):
    busy_server, silent_server = engines(), engines()
    client = engines()
    busy = busy_server.register(bytearray(1 << 16))
    silent = silent_server.register(bytearray(1 << 16))
    client.read(silent, 0, bytearray(10))
    fabric.silent.add(silent_server._transports["rdma"].dev)
    stuck = client.submit([Op(READ, bytearray(100), 0, silent, 0, 100)])
    start = time.monotonic()
    while not stuck.poll() and time.monotonic() - start < TIMEOUT * 3:
        client.read(busy, 0, bytearray(1000))  # completions keep flowing meanwhile
    with pytest.raises(TransferTimeout):
        stuck.wait(0)
    assert time.monotonic() - start < TIMEOUT * 2
