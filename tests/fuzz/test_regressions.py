"""Crashes the fuzzers found (issue 14), each kept as a regression test of its own.

- tiers.ssd.recover: a meta record whose key no put could have written (NUL, empty, over 512
  bytes) was indexed on open, then listed by `keys()` (and reported to the master), and `get` of
  it raised InvalidArgument. Now `_parse_meta` drops it with the other damaged records.
- rpc server: a frame header announcing a 64 MiB message made the server allocate (and zero)
  64 MiB before one byte of it arrived, per connection: a few idle connections held gigabytes.
  Now the body grows as its bytes arrive.
- rpc client: a reply header announcing up to 4 GiB of message made the client allocate that
  much at once (`recv(msg_len)`), with no bound at all. Now a reply over MAX_MESSAGE (or a payload
  over MAX_PAYLOAD) breaks the connection (`Unavailable`) before anything is allocated.
- worker POST /v1/tokenize {"messages": []}: the chat template raised ValueError, answered 500.
  Now `TokenizeRequest` refuses empty messages when decoded (400).
- tiers.ssd.meta (atheris, in 0.1 s): a meta record keyed "a\x00c" parsed, and the fuzz check
  called that a key no put could write. It was the check that was wrong: since issue 13 that is a
  tenant-scoped stored key, which the tier stores. The check now uses `check_stored_key`, as the
  tier does; the test below pins that such a record survives a reopen.
"""

from __future__ import annotations

import socket
import time
import tracemalloc

import lmdb
import pytest
import xxhash

from fuzz_support import LyingServer
from kvpool.errors import Unavailable
from kvpool.messages import PROTOCOL_VERSION, Hello
from kvpool.rpc.client import RpcClient
from kvpool.rpc.frame import HEADER, MAX_MESSAGE
from kvpool.tiers.ssd import MAGIC, META, VERSION, SsdTier, _lmdb_key


# "a\x00b" is a tenant-scoped stored key since issue 13 (kvpool.contract.check_stored_key); a NUL with no
# tenant before it, two NULs, or an empty or over-long key is still invalid.
@pytest.mark.parametrize("key", ["\x00", "\x00b", "a\x00\x00b", "", "k" * 513])
def test_ssd_recover_drops_a_record_with_an_invalid_key(tmp_path, key):
    SsdTier(str(tmp_path), 1 << 20).close()
    env = lmdb.open(str(tmp_path), map_size=(1 << 20) * 2 + (64 << 20), max_dbs=2)
    meta_db, data_db = env.open_db(b"meta"), env.open_db(b"data")
    with env.begin(write=True) as txn:
        for k, data in ((key, b"bad"), ("good", b"fine")):
            kb = k.encode()
            txn.put(_lmdb_key(k), META.pack(MAGIC, VERSION, len(kb), len(data), xxhash.xxh3_64_intdigest(data)) + kb,
                    db=meta_db)
            txn.put(_lmdb_key(k), data, db=data_db)
    env.close()
    tier = SsdTier(str(tmp_path), 1 << 20)
    try:
        assert [k for k, _ in tier.keys()] == ["good"]
        assert tier.get("good") == b"fine"
    finally:
        tier.close()


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_rpc_server_does_not_allocate_an_announced_message_before_it_arrives(tmp_path):
    from test_sockets import _serve

    served = _serve(tmp_path)
    conns = []
    try:
        before = _rss_mib(served.proc.pid)
        for _ in range(8):  # 8 x 64 MiB announced, 10 bytes sent
            s = socket.create_connection(served.rpc(), timeout=5)
            s.sendall(HEADER.pack(PROTOCOL_VERSION, 0, MAX_MESSAGE, 0) + b"\x92" * 10)
            conns.append(s)
        time.sleep(1.0)
        grown = _rss_mib(served.proc.pid) - before
        assert grown < 128, f"kvpool serve grew by {grown:.0f} MiB for 8 announced-but-unsent messages"
        for s in conns:
            s.close()
        served.assert_serving()
    finally:
        for s in conns:
            s.close()
        served.proc.terminate()
        served.proc.wait(15)


@pytest.mark.parametrize("msg_len,payload_len", [(0xFFFFFFFF, 0), (MAX_MESSAGE + 1, 0), (4, 1 << 62)])
def test_rpc_client_refuses_an_oversized_reply(msg_len, payload_len, monkeypatch):
    monkeypatch.setenv("KVPOOL_LOCAL_AUTH", "off")  # the lie is in the reply to a request, not the handshake
    server = LyingServer(HEADER.pack(PROTOCOL_VERSION, 0, msg_len, payload_len) + b"\x91\x00\x00\x00", hold=True)
    client = RpcClient(server.address, timeout=2.0)
    tracemalloc.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(Unavailable):
            client.call(Hello(PROTOCOL_VERSION, "fuzz"))
        _, peak = tracemalloc.get_traced_memory()
        assert peak < 32 << 20, f"the client allocated {peak >> 20} MiB for a lying reply header"
        assert time.monotonic() - t0 < 1.5, "the client waited for bytes it should have refused"
    finally:
        tracemalloc.stop()
        client.close()
        server.close()


def test_rpc_server_still_reads_messages_larger_than_its_buffer(tmp_path):
    """The grown-as-it-arrives path: a 1.5 MiB message (far over the 16 KiB read-ahead)."""
    from test_sockets import _serve

    from kvpool.messages import Bools, Exists

    served = _serve(tmp_path)
    client = RpcClient(served.address)
    try:
        keys = [f"big/{i:06d}/" + "x" * 100 for i in range(15000)]
        reply = client.call(Exists(keys))
        assert isinstance(reply, Bools) and reply.values == [False] * len(keys)
        served.assert_serving()
    finally:
        client.close()
        served.proc.terminate()
        served.proc.wait(15)


def test_tokenize_request_with_no_messages_is_invalid():
    from kvpool import worker_api
    from kvpool.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="messages must not be empty"):
        worker_api.decode(b'{"v":1,"messages":[]}', worker_api.TokenizeRequest)
    assert worker_api.decode(b'{"v":1,"prompt":"hi"}', worker_api.TokenizeRequest).prompt == "hi"


@pytest.mark.model
def test_worker_answers_400_to_an_empty_conversation(worker_http):
    resp = worker_http.post("/v1/tokenize", content=b'{"v":1,"messages":[]}')
    assert resp.status_code == 400, resp.text
    assert resp.json()["code"] == "invalid_argument"


# The input atheris found (tiers.ssd.meta): magic, version 1, key length 3, length 10, then "a\0c".
ATHERIS_SSD_META = bytes.fromhex("4b565353 0100 0300 0a00000000000000 6300080000000000 610063")


def test_ssd_keeps_a_tenant_scoped_record_across_a_reopen(tmp_path):
    assert SsdTier._parse_meta(memoryview(ATHERIS_SSD_META))[0] == "a\x00c"
    tier = SsdTier(str(tmp_path), 1 << 20)
    tier.put("a\x00c", b"0123456789")
    tier.close()
    tier = SsdTier(str(tmp_path), 1 << 20)
    try:
        assert [k for k, _ in tier.keys()] == ["a\x00c"]
        assert tier.get("a\x00c") == b"0123456789"
    finally:
        tier.close()
