"""Engine behaviour that does not depend on a transport: buffers, selection, batches, asyncio."""

from __future__ import annotations

import asyncio
import mmap
import os

import numpy as np
import pytest
import torch

from transfer import (READ, WRITE, Batch, InvalidOp, Op, SegmentNotFound, TransferEngine, TransferError,
                      TransportUnavailable, create_shm_buffer)


@pytest.fixture
def pair():
    a = TransferEngine(timeout=2.0).start()
    b = TransferEngine(timeout=2.0).start()
    mapping, path = create_shm_buffer(1 << 20)
    yield a, b, mapping, path
    a.close()
    b.close()
    os.unlink(path)


def test_transport_choice_prefers_shm_on_same_host_and_honours_override(pair):
    a, b, mapping, path = pair
    shm_seg = b.register(mapping, shm_path=path)
    plain_seg = b.register(bytearray(4096))
    assert a.choose(shm_seg) == "shm"
    assert a.choose(plain_seg) == "tcp"  # not a mapping: only tcp is offered
    assert a.choose(shm_seg, "tcp") == "tcp"
    with pytest.raises(TransportUnavailable):
        a.choose(plain_seg, "shm")
    tcp_only = TransferEngine(transports=["tcp"])
    try:
        assert tcp_only.choose(shm_seg) == "tcp"
        with pytest.raises(TransportUnavailable):
            tcp_only.choose(shm_seg, "shm")
    finally:
        tcp_only.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_buffer_kinds(pair, transport):
    a, b, mapping, path = pair
    seg = b.register(mapping, shm_path=path)
    np.frombuffer(mapping, dtype=np.uint8)[:] = np.arange(1 << 20, dtype=np.uint64).view(np.uint8)[: 1 << 20]
    expected = bytes(mapping[4096:8192])
    local_map = mmap.mmap(-1, 4096)
    for local in (bytearray(4096), np.zeros(1024, dtype=np.float32), torch.zeros(2048, dtype=torch.bfloat16),
                  memoryview(bytearray(4096)), local_map):
        a.read(seg, 4096, local, transport=transport)
        got = local.view(torch.uint8).numpy().tobytes() if isinstance(local, torch.Tensor) else bytes(memoryview(local).cast("B"))
        assert got == expected, type(local)
    a.write(seg, 0, torch.full((16,), 3, dtype=torch.int32), transport=transport)
    assert bytes(mapping[:64]) == np.full(16, 3, dtype=np.int32).tobytes()
    a.write(seg, 100, b"read-only source is fine for WRITE", transport=transport)
    assert bytes(mapping[100:104]) == b"read"


def test_invalid_ops_and_registrations(pair):
    a, b, mapping, path = pair
    seg = b.register(bytearray(100), name="small")
    with pytest.raises(InvalidOp):
        b.register(bytearray(10), name="small")
    with pytest.raises(InvalidOp):
        b.register(bytearray(0))
    with pytest.raises(InvalidOp):
        b.register(b"immutable")
    with pytest.raises(InvalidOp):
        b.register(np.zeros((4, 4))[:, 1])  # not contiguous
    with pytest.raises(InvalidOp):
        b.register(bytearray(1 << 21), shm_path=path)  # larger than the file
    with pytest.raises(InvalidOp):
        a.submit([Op(7, bytearray(1), 0, seg, 0, 1)])
    with pytest.raises(InvalidOp):
        a.submit([Op(READ, bytearray(1), 0, seg, -1, 1)])
    with pytest.raises(InvalidOp):
        a.submit([Op(READ, bytearray(1), 0, "not a descriptor", 0, 1)])
    with pytest.raises(InvalidOp):
        TransferEngine(transports=["carrier-pigeon"])
    with pytest.raises(SegmentNotFound):
        b.unregister("nope")
    b.unregister("small")
    with pytest.raises(TransferError):
        a.read(seg, 0, bytearray(4))


def test_batch_wait_poll_and_await(pair):
    a, b, mapping, path = pair
    seg = b.register(bytearray(b"x" * (8 << 20)))
    out = bytearray(8 << 20)
    batch = a.submit([Op(READ, out, 0, seg, 0, 8 << 20)])
    batch.wait(timeout=10)
    assert batch.poll() and out == b"x" * (8 << 20)

    async def main():
        outs = [bytearray(1 << 20) for _ in range(8)]
        batches = [a.submit([Op(READ, o, 0, seg, 0, 1 << 20)]) for o in outs]
        await asyncio.gather(*(asyncio.ensure_future(_awaitable(b)) for b in batches))
        assert all(o == b"x" * (1 << 20) for o in outs)
        bad = a.submit([Op(READ, bytearray(4), 0, seg.__class__(**{**_fields(seg), "seg_id": 999}), 0, 4)])
        with pytest.raises(SegmentNotFound.__mro__[1]):  # TransferError carrying the per-op cause
            await bad
        assert isinstance(bad.failures[0], SegmentNotFound)

    asyncio.run(main())
    empty = a.submit([])
    assert empty.poll()
    empty.wait()


async def _awaitable(batch: Batch) -> None:
    await batch


def _fields(seg):
    return {f: getattr(seg, f) for f in seg.__struct_fields__}


def test_per_op_failures_do_not_fail_the_others(pair):
    a, b, mapping, path = pair
    good = b.register(bytearray(b"g" * 1000))
    other_buf = bytearray(100)
    other = b.register(other_buf)
    gone = good.__class__(**{**_fields(good), "seg_id": 999})
    out1, out2 = bytearray(1000), bytearray(1000)
    # ops of one batch run concurrently and unordered, so they touch disjoint bytes here
    batch = a.submit([Op(READ, out1, 0, good, 0, 1000), Op(READ, out2, 0, gone, 0, 1000),
                      Op(WRITE, b"w" * 10, 0, other, 0, 10)])
    with pytest.raises(TransferError) as info:
        batch.wait(5)
    assert set(info.value.failures) == {1}
    assert out1 == b"g" * 1000 and other_buf[:10] == b"w" * 10


def test_unreachable_peer_fails_fast(pair):
    a, b, mapping, path = pair
    seg = b.register(bytearray(100))
    b.close()  # nobody listens on that port any more
    with pytest.raises(TransferError):
        a.submit([Op(READ, bytearray(10), 0, seg, 0, 10)] * 3).wait(timeout=5)
    with pytest.raises(TransferError):
        a.read(seg, 0, bytearray(10))


def test_sync_read_survives_peer_restart_on_same_port(pair):
    a, b, mapping, path = pair
    seg = b.register(bytearray(b"1" * 100), name="s")
    out = bytearray(100)
    a.read(seg, 0, out, transport="tcp")  # leaves a pooled connection to b
    port = b.port
    b.close()
    try:
        c = TransferEngine(port=port, transports=["tcp"]).start()
    except OSError:
        pytest.skip("port was taken by someone else in between")
    try:
        seg2 = c.register(bytearray(b"2" * 100), name="s")
        a.read(seg2, 0, out, transport="tcp")
        assert out == b"2" * 100
    finally:
        c.close()


def test_mixed_transport_batch_completes_only_when_all_parts_do(pair):
    a, b, mapping, path = pair
    shm_seg = b.register(mapping, shm_path=path)
    tcp_seg = b.register(bytearray(b"t" * (4 << 20)))
    mapping[:10] = b"s" * 10
    out_t, out_s = bytearray(4 << 20), bytearray(10)
    for _ in range(20):
        batch = a.submit([Op(READ, out_t, 0, tcp_seg, 0, 4 << 20), Op(READ, out_s, 0, shm_seg, 0, 10)])
        assert batch.transport == "mixed"
        batch.wait(10)
        assert out_t == b"t" * (4 << 20) and out_s == b"s" * 10


def test_close_does_not_wait_for_a_silent_peer():
    import signal
    import time

    from transfer_peer import Peer

    peer = Peer(1 << 20, 1, "tcp")
    eng = TransferEngine(transports=["tcp"], timeout=5.0).start()
    try:
        eng.read(peer.pattern_seg, 0, bytearray(10))
        peer.signal(signal.SIGSTOP)
        batch = eng.submit([Op(READ, bytearray(1 << 20), 0, peer.pattern_seg, 0, 1 << 20)] * 4)
        start = time.monotonic()
        eng.close()
        assert time.monotonic() - start < 2.0
        with pytest.raises(TransferError):
            batch.wait(1.0)  # every op finished (failed) by close
    finally:
        eng.close()
        peer.stop()


def test_mixed_reads_and_writes_on_one_connection_do_not_deadlock():
    """Big READ responses and big WRITE payloads crossing on one socket must not block each other.

    Slices are far larger than any socket buffer, so a client that sent a WRITE payload while
    READ responses were due would block against a server blocked sending those responses.
    """
    mib = 1 << 20
    server = TransferEngine(transports=["tcp"], timeout=3.0).start()
    client = TransferEngine(transports=["tcp"], timeout=3.0, connections_per_peer=1, slice_bytes=48 * mib)
    try:
        remote = bytearray(b"r" * (192 * mib))
        seg = server.register(remote)
        src = b"w" * (48 * mib)
        outs = [bytearray(48 * mib) for _ in range(2)]
        ops = []
        for i in range(2):
            ops.append(Op(READ, outs[i], 0, seg, i * 48 * mib, 48 * mib))
            ops.append(Op(WRITE, src, 0, seg, (96 + i * 48) * mib, 48 * mib))
        client.submit(ops).wait(timeout=60)
        assert all(o == b"r" * (48 * mib) for o in outs)
        assert remote[96 * mib:] == b"w" * (96 * mib)
    finally:
        client.close()
        server.close()


def test_staging_touches_only_the_op_range():
    """transfer.staging on a CPU tensor (the function is device-agnostic; the engine uses it for CUDA)."""
    from transfer import staging

    dev = torch.arange(16, dtype=torch.int32)  # 64 bytes
    op = Op(READ, dev, 8, "desc", 0, 16)
    host_op, hook = staging.stage(0, op)
    assert host_op.local_offset == 0 and host_op.local.numel() == 16 and host_op.remote == "desc"
    host_op.local.copy_(torch.full((16,), 0xFF, dtype=torch.uint8))
    hook()
    assert dev[:2].tolist() == [0, 1] and dev[2:6].tolist() == [-1] * 4 and dev[6:].tolist() == list(range(6, 16))
    write_op, hook = staging.stage(0, Op(WRITE, dev, 0, "desc", 0, 8))
    assert hook is None and bytes(write_op.local.numpy()) == dev[:2].numpy().tobytes()
    with pytest.raises(InvalidOp):
        staging.stage(0, Op(READ, dev, 60, "desc", 0, 8))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_cuda_tensors_as_local_buffers(pair, transport):
    a, b, mapping, path = pair
    seg = b.register(mapping, shm_path=path)
    src = torch.arange(1 << 18, dtype=torch.float32, device="cuda")  # 1 MiB
    a.write(seg, 0, src, transport=transport)
    dst = torch.zeros_like(src)
    batch = a.submit([Op(READ, dst, 0, seg, 0, 1 << 20)], transport=transport)
    batch.wait(10)
    assert torch.equal(dst, src)
    with pytest.raises(InvalidOp):
        b.register(src)


def test_batch_hooks_run_before_done_and_a_failing_hook_fails_its_op():
    order = []
    batch = Batch([None, None])
    batch._hooks = [(0, lambda: order.append(("hook", batch.poll()))), (1, lambda: 1 / 0)]
    batch.add_done_callback(lambda: order.append(("callback", batch.poll())))
    batch._expect(2)
    batch._seal()
    batch._slice_done(0)
    assert not batch.poll()
    batch._slice_done(1)
    assert order == [("hook", False), ("callback", True)]
    with pytest.raises(TransferError) as info:
        batch.wait(1)
    assert set(info.value.failures) == {1}
