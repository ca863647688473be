"""The TCP data server against hostile or broken clients: raw frames on a real socket.

Every case checks that the server answered (or closed) as documented AND that a well-behaved
client on another connection is still served afterwards.
"""

from __future__ import annotations

import socket
import struct

import pytest

from transfer import InvalidOp, ProtocolError, SegmentNotFound, TransferEngine, wire

SEG_SIZE = 1 << 16
DATA = 1  # the first segment an engine registers gets seg_id 1


@pytest.fixture
def server():
    eng = TransferEngine(transports=["tcp"], timeout=2.0).start()
    buf = bytearray(range(256)) * (SEG_SIZE // 256)
    seg = eng.register(buf, name="data")
    assert seg.seg_id == DATA
    yield eng, seg, buf
    eng.close()


@pytest.fixture
def client():
    eng = TransferEngine(transports=["tcp"], timeout=2.0)
    yield eng
    eng.close()


def _conn(eng) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", eng.port), timeout=5)
    return sock


NO_SUCH = 999


def _request(opcode: int, seg_id: int, offset: int, length: int, version: int = wire.VERSION,
             magic: int = wire.MAGIC) -> bytes:
    return wire.REQ.pack(magic, version, opcode, 0, seg_id, 9, offset, length)


def _response(sock: socket.socket) -> tuple[int, bytes]:
    hdr = b""
    while len(hdr) < wire.RESP.size:
        chunk = sock.recv(wire.RESP.size - len(hdr))
        if not chunk:
            raise ConnectionError("closed")
        hdr += chunk
    magic, version, status, _, req_id, length = wire.RESP.unpack(hdr)
    assert magic == wire.MAGIC and req_id == 9
    body = b""
    while len(body) < length:
        body += sock.recv(length - len(body))
    return status, body


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _still_serving(client, seg, buf) -> None:
    out = bytearray(100)
    client.read(seg, 1000, out)
    assert out == buf[1000:1100]


def test_garbage_bytes_close_only_that_connection(server, client):
    eng, seg, buf = server
    _still_serving(client, seg, buf)  # an established connection that must survive
    with _conn(eng) as bad:
        bad.sendall(b"\x00GET / HTTP/1.1\r\n\r\n" + bytes(64))
        assert _closed(bad)
    _still_serving(client, seg, buf)


def test_truncated_frame_then_close(server, client):
    eng, seg, buf = server
    with _conn(eng) as bad:
        bad.sendall(_request(wire.OP_WRITE, DATA, 0, 1000)[:20])
    with _conn(eng) as bad:  # header complete, payload cut short: nothing may be half-applied silently
        bad.sendall(_request(wire.OP_WRITE, DATA, 0, 1000) + b"\xff" * 10)
    _still_serving(client, seg, buf)


def test_bad_version_gets_error_reply(server, client):
    eng, seg, buf = server
    with _conn(eng) as bad:
        bad.sendall(_request(wire.OP_READ, DATA, 0, 10, version=99))
        status, body = _response(bad)
        assert status == wire.E_VERSION and b"version" in body
        assert _closed(bad)
    _still_serving(client, seg, buf)


def test_unknown_segment_and_out_of_range_get_error_replies_and_keep_connection(server):
    eng, seg, buf = server
    before = bytes(buf)
    with _conn(eng) as sock:
        sock.sendall(_request(wire.OP_READ, NO_SUCH, 0, 10))
        assert _response(sock)[0] == wire.E_NO_SEGMENT
        sock.sendall(_request(wire.OP_WRITE, DATA, SEG_SIZE - 4, 8) + b"Z" * 8)
        assert _response(sock)[0] == wire.E_RANGE
        sock.sendall(_request(wire.OP_WRITE, NO_SUCH, 0, 8) + b"Z" * 8)
        assert _response(sock)[0] == wire.E_NO_SEGMENT
        sock.sendall(_request(42, DATA, 0, 0))  # unknown opcode: reply, then close
        assert _response(sock)[0] == wire.E_BAD_REQUEST
        assert _closed(sock)
    assert bytes(buf) == before  # no refused write touched the segment
    with _conn(eng) as sock:  # the same connection form still works for good requests
        sock.sendall(_request(wire.OP_READ, DATA, 10, 4))
        assert _response(sock) == (wire.OK, bytes(buf[10:14]))


def test_oversized_and_bad_control_frames(server, client):
    eng, seg, buf = server
    with _conn(eng) as bad:
        bad.sendall(_request(wire.OP_WRITE, DATA, 0, 1 << 40))
        assert _response(bad)[0] == wire.E_BAD_REQUEST
        assert _closed(bad)
    with _conn(eng) as bad:
        bad.sendall(_request(wire.OP_CONTROL, 0, 0, 5) + b"\x93abcd")
        status, body = _response(bad)
        assert status == wire.E_BAD_REQUEST and b"bad control message" in body
    _still_serving(client, seg, buf)


def test_client_sees_typed_errors(server, client):
    eng, seg, buf = server
    missing = type(seg)(**{**{f: getattr(seg, f) for f in seg.__struct_fields__}, "seg_id": NO_SUCH})
    with pytest.raises(SegmentNotFound):
        client.read(missing, 0, bytearray(4))
    with pytest.raises(InvalidOp):
        client.read(seg, SEG_SIZE - 2, bytearray(4))
    # A descriptor lying about its size: the client check passes, the server refuses.
    liar = type(seg)(**{**{f: getattr(seg, f) for f in seg.__struct_fields__}, "size": SEG_SIZE * 2})
    with pytest.raises(InvalidOp):
        client.read(liar, SEG_SIZE, bytearray(4))
    _still_serving(client, seg, buf)


def test_stale_descriptor_never_reaches_a_reregistered_buffer(server, client):
    eng, seg, buf = server
    eng.unregister("data")
    eng.register(bytearray(SEG_SIZE), name="data")  # same name, another buffer
    with pytest.raises(SegmentNotFound):
        client.read(seg, 0, bytearray(4))


def test_descriptor_roundtrip_and_rejects_garbage(server):
    _, seg, _ = server
    assert type(seg).from_bytes(seg.to_bytes()) == seg
    with pytest.raises(ProtocolError):
        type(seg).from_bytes(b"\x00\x01garbage")
    with pytest.raises(ProtocolError):
        type(seg).from_bytes(struct.pack("<I", 7))
