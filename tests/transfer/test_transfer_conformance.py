"""One conformance suite every transport runs: bit-exact payloads, concurrency, failures.

The peer is a real engine in another process; "rdma" runs only where pyverbs finds a device
(its logic is also covered against the fake verbs layer in test_transfer_rdma.py).
"""

from __future__ import annotations

import random
import signal
import threading
import time

import numpy as np
import pytest

from transfer_peer import Peer, pattern
from transfer import READ, WRITE, Op, TransferEngine, TransferError, TransferTimeout
from transfer.verbs import unavailable_reason

TIMEOUT = 2.0
SIZE = 8 << 20


def _rdma_param():
    reason = unavailable_reason()
    return pytest.param("rdma", marks=[pytest.mark.rdma, pytest.mark.skipif(reason is not None, reason=reason or "")])


TRANSPORTS = ["shm", "tcp", _rdma_param()]


@pytest.fixture(scope="module")
def shared_peer():
    peer = Peer(SIZE, 7, "shm,tcp,rdma")
    yield peer
    peer.stop()


@pytest.fixture
def engine(transport):
    # small slices so multi-slice ops and several connections are exercised with small payloads
    eng = TransferEngine(transports=[transport], timeout=TIMEOUT, slice_bytes=256 << 10).start()
    yield eng
    eng.close()


SIZES = [1, 7, 4095, 4096, 65536, (256 << 10) + 3, 1 << 20, (3 << 20) + 17]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_random_reads_and_writes_are_bit_exact(transport, engine, shared_peer):
    rng = random.Random(42)
    expected = pattern(SIZE, shared_peer.seed)
    ops, outs = [], []
    for size in SIZES * 3:
        remote_off = rng.randrange(0, SIZE - size + 1)
        local_off = rng.randrange(0, 64)
        out = bytearray(size + local_off + 5)
        ops.append(Op(READ, out, local_off, shared_peer.pattern_seg, remote_off, size))
        outs.append((out, local_off, remote_off, size))
    engine.submit(ops).wait()
    for out, local_off, remote_off, size in outs:
        assert out[local_off:local_off + size] == expected[remote_off:remote_off + size].tobytes()
        assert out[:local_off] == bytes(local_off) and out[local_off + size:] == bytes(5)

    # Writes at disjoint random places of scratch, then read back (reads are verified above).
    data = {}
    write_ops = []
    cursor = 0
    for size in SIZES:
        payload = np.frombuffer(rng.randbytes(size), dtype=np.uint8)
        off = cursor + rng.randrange(0, 4096)
        cursor = off + size
        data[off] = payload
        write_ops.append(Op(WRITE, payload, 0, shared_peer.scratch_seg, off, size))
    assert cursor <= SIZE
    engine.submit(write_ops).wait()
    for off, payload in data.items():
        back = np.zeros(len(payload), dtype=np.uint8)
        engine.read(shared_peer.scratch_seg, off, back)
        assert np.array_equal(back, payload)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_64_concurrent_batches(transport, engine, shared_peer):
    expected = pattern(SIZE, shared_peer.seed)
    chunk = SIZE // 64
    batches, outs = [], []
    for i in range(64):
        out = bytearray(chunk)
        outs.append(out)
        ops = [Op(READ, out, 0, shared_peer.pattern_seg, i * chunk, chunk // 2),
               Op(READ, out, chunk // 2, shared_peer.pattern_seg, i * chunk + chunk // 2, chunk // 2)]
        batches.append(engine.submit(ops))
    errors = []

    def waiter(group):
        try:
            for b in group:
                b.wait(timeout=30)
        except Exception as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=waiter, args=(batches[k::4],)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i, out in enumerate(outs):
        assert out == expected[i * chunk:(i + 1) * chunk].tobytes()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_peer_killed_mid_batch_fails_within_timeout(transport, engine, make_peer):
    peer = make_peer(size=SIZE, transports="shm,tcp,rdma")
    out = bytearray(SIZE)
    if transport != "shm":
        peer.signal(signal.SIGSTOP)  # the kill lands while the batch's slices are in flight
    start = time.monotonic()
    batch = engine.submit([Op(READ, out, 0, peer.pattern_seg, 0, SIZE)] * 8)
    peer.signal(signal.SIGKILL)
    peer.proc.wait()
    try:
        batch.wait(timeout=TIMEOUT * 3)
        assert transport == "shm", "a batch to a stopped-then-killed peer cannot succeed"
    except TransferError as exc:
        assert not isinstance(exc, TransferTimeout) or exc.failures, "batch.wait itself ran out"
        assert exc.failures
    assert time.monotonic() - start < TIMEOUT * 2
    # After the death new ops fail, typed, within the timeout on every transport (shm notices
    # a dead owner within its liveness interval; tcp and rdma at once).
    start = time.monotonic()
    while True:
        try:
            engine.submit([Op(READ, out, 0, peer.pattern_seg, 0, 1 << 20)]).wait(timeout=TIMEOUT * 3)
        except TransferError:
            break
        assert time.monotonic() - start < TIMEOUT, "ops to a dead peer kept succeeding"
        time.sleep(0.01)
    assert time.monotonic() - start < TIMEOUT * 1.5


@pytest.mark.parametrize("transport", [t for t in TRANSPORTS if t != "shm"])
def test_stopped_peer_times_out(transport, engine, make_peer):
    peer = make_peer(size=SIZE, transports="tcp,rdma")
    out = bytearray(SIZE)
    engine.read(peer.pattern_seg, 0, out, 0, 1024)  # connected and working
    peer.signal(signal.SIGSTOP)
    start = time.monotonic()
    batch = engine.submit([Op(READ, out, 0, peer.pattern_seg, 0, SIZE)] * 4)
    with pytest.raises(TransferTimeout) as info:
        batch.wait(timeout=TIMEOUT * 4)
    assert set(info.value.failures) == {0, 1, 2, 3}
    assert time.monotonic() - start < TIMEOUT * 2
    peer.signal(signal.SIGCONT)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_bad_ranges_are_refused_before_any_byte_moves(transport, engine, shared_peer):
    seg = shared_peer.scratch_seg
    from transfer import InvalidOp

    with pytest.raises(InvalidOp):
        engine.submit([Op(WRITE, b"x" * 10, 0, seg, 0, 10), Op(WRITE, b"y" * 10, 0, seg, SIZE - 5, 10)])
    with pytest.raises(InvalidOp):
        engine.submit([Op(WRITE, b"x" * 10, 0, seg, 0, 10), Op(READ, bytearray(4), 0, seg, 0, 10)])
    with pytest.raises(InvalidOp):
        engine.submit([Op(WRITE, b"x" * 10, 0, seg, 0, 10), Op(READ, b"read-only", 0, seg, 0, 4)])
    back = bytearray(10)
    engine.read(seg, 0, back)
    assert back != b"x" * 10  # the valid first op of each refused batch never ran


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_garbage_to_the_tcp_port_leaves_the_peer_serving(transport, engine, make_peer):
    import socket

    peer = make_peer(size=1 << 20, transports="shm,tcp,rdma")
    expected = pattern(1 << 20, peer.seed)
    out = bytearray(4096)
    engine.read(peer.pattern_seg, 0, out)  # a connection that is open while the garbage arrives
    for junk in (b"\xde\xad\xbe\xef" * 100, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"KVTP"[:3]):
        with socket.create_connection((peer.pattern_seg.host, peer.pattern_seg.port), timeout=5) as bad:
            try:
                bad.sendall(junk)
                bad.shutdown(socket.SHUT_WR)
                while bad.recv(4096):
                    pass  # the server closes a garbage connection; it never hangs on one
            except OSError:
                pass  # closed (or reset) by the server before we were done: also fine
    for off in (0, 4096, (1 << 20) - 4096):
        engine.read(peer.pattern_seg, off, out)
        assert out == expected[off:off + 4096].tobytes()
    assert peer.proc.poll() is None
