"""`kvpool.rpc.frame.send_frame`: one frame in one `sendmsg`, and the rest of it intact when the
kernel takes only part (a send timeout that expires mid-frame), over a real socket pair."""

from __future__ import annotations

import socket
import struct
import threading
import time

import numpy as np

from kvpool.messages import NodeGet
from kvpool.rpc.frame import HEADER, encoder, send_frame
from transfer.framing import recv_exact_into


def _read_frame(sock: socket.socket, slow: bool) -> tuple[tuple, bytes, bytes]:
    head = bytearray(HEADER.size)
    recv_exact_into(sock, memoryview(head))
    version, flags, msg_len, payload_len = HEADER.unpack(head)
    body = bytearray(msg_len)
    recv_exact_into(sock, memoryview(body))
    payload = bytearray(payload_len)
    view, got = memoryview(payload), 0
    while got < payload_len:
        n = sock.recv_into(view[got:], min(payload_len - got, 64 << 10))
        assert n, "peer closed mid-frame"
        if slow and not got:  # stall once: the sender's 20 ms timeout expires with the frame half sent
            time.sleep(0.03)
        got += n
    return (version, flags, msg_len, payload_len), bytes(body), bytes(payload)


def _roundtrip(buffers, slow: bool):
    a, b = socket.socketpair()
    try:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 10)
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 0, 20_000))  # 20 ms
        got = {}
        reader = threading.Thread(target=lambda: got.update(frame=_read_frame(b, slow)))
        reader.start()
        send_frame(a, NodeGet(["k"]), buffers, flags=2)
        reader.join(timeout=30)
        return got["frame"]
    finally:
        a.close()
        b.close()


def test_one_view_whole_frame():
    data = np.arange(1 << 20, dtype=np.uint8)
    (version, flags, msg_len, payload_len), body, payload = _roundtrip([memoryview(data)], slow=False)
    assert flags == 2 and body == encoder.encode(NodeGet(["k"])) and msg_len == len(body)
    assert payload_len == data.nbytes and payload == data.tobytes()


def test_partial_sends_keep_the_frame_intact():
    # several buffers of mixed kinds and formats; the reader is slow enough that the sender's
    # 20 ms timeout cuts its sendmsg short, so the rest goes through send_all
    parts = [b"abc", np.arange(300_000, dtype=np.int32), memoryview(bytearray(b"x" * 70_000)), b""]
    _, _, payload = _roundtrip(parts, slow=True)
    assert payload == b"".join(memoryview(p).cast("B").tobytes() for p in parts)


def test_no_payload():
    (_, _, msg_len, payload_len), body, payload = _roundtrip((), slow=False)
    assert payload_len == 0 and payload == b"" and len(body) == msg_len
