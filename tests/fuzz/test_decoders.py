"""Fuzz every decoder that reads bytes from the network or from disk (issue 14).

Property, for each target: arbitrary bytes, or a mutation of a valid encoding, give either a
valid object or the module's own documented error (kvpool.errors for kvpool, transfer.errors for
the transfer engine, transfer.auth.AuthError for the handshake, msgspec.DecodeError where the
caller catches exactly that), never another exception. atheris_targets.py runs the same checks
coverage-guided. Each target gets `EXAMPLES` inputs in the default suite and `LONG_EXAMPLES` in `slow`;
how many each really tried is printed at the end of the run ("fuzz inputs tried per target").
"""

from __future__ import annotations

import socket
import tempfile

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzz_support import EXAMPLES, LONG_EXAMPLES, TRIED, fuzz_bytes, fuzz_settings
from kvpool import messages as m
from kvpool import worker_api
from kvpool.contract import check_stored_key
from kvpool.chunk_format import KVLayout, decode_chunk, encode_chunk, read_header
from kvpool.errors import KVPoolError
from kvpool.handle import KVHandle
from kvpool.rpc.frame import reply_decoder, request_decoder
from transfer import auth, wire
from transfer.descriptor import RdmaEndpoint, SegmentDescriptor
from transfer.errors import TransferError

enc = msgspec.msgpack.Encoder()
NODE = m.NodeInfo("n1", "127.0.0.1:7000", "h", ["seg"], None, {"dram": 1 << 20}, b"\x01\x02", "/i", "@u")

REQUEST_SEEDS = [enc.encode(x) for x in [
    m.Hello(1, "c"), m.PutStart(["a", "b"], [1, 2], 2, "n1"), m.PutEnd(["a"], [3], [[m.Placed("n1", "dram", "s", 0)]]),
    m.Lookup(["a"], [1], True), m.Release([1, 2]), m.Exists(["a"]), m.MatchPrefix(["a", "b"]), m.Remove(["a"]),
    m.RegisterNode(NODE, [m.Held("a", 1, "dram", 2)]), m.Heartbeat("n1", {"x": 1}, [m.Held("a", 1, "ssd", 2)], []),
    m.Admin("stats", {"k": [1, "x"]}), m.NodeGet(["a"], [1]), m.NodePin(["a"], [], False), m.NodeUnpin([1], ["a"]),
    m.NodeWrite(["a"], [4], [0], 1), m.NodeRemove(["a"], [0]), m.NodeCopy(["a"], [1], "127.0.0.1:1"), m.NodeStats(),
    m.NodeReserve(["a"], [4], [0], 1, [2]), m.NodeCommit(["a"], [1], [True]),
]]
REPLY_SEEDS = [enc.encode(x) for x in [
    m.Ok(), m.Err("not_found", "x"), m.Bools([True]), m.Count(3), m.Info({"a": {"b": 1}}),
    m.HelloReply(1, ["master", "node"], True, NODE, 1 << 20, 2, "h", "@u"),
    m.PutPlans([m.PutPlan(1, [m.Target("n1", "a:1")]), m.Err("capacity", "full")]), m.BatchResult([None, m.Err("x", "y")]),
    m.LookupReply(3, [m.Entry(4, [m.Location("n1", "a:1", "dram", 0)]), None]), m.HeartbeatReply(True),
    m.NodeData([4, -1]), m.Pins(1, [0, -1], [4, 5]), m.WriteReply([m.Placed("n", "dram", "s", 0), m.Err("a", "b")]),
    m.Slots([m.Slot(1, 0), m.Err("a", "b")], b"seg"),
]]


def run(target: str, strategy, check, examples: int) -> None:
    @fuzz_settings(examples)
    @given(strategy)
    def inner(data):
        TRIED[target] += 1
        check(data)

    inner()


# ---- targets: name -> (strategy, check) ------------------------------------------------------

def _msgspec_only(decoder):
    def check(data: bytes) -> None:
        try:
            decoder.decode(data)
        except msgspec.DecodeError:  # what the RPC server and client catch (ValidationError is one)
            pass
    return check


CONTROL_SEEDS = [enc.encode(x) for x in [
    wire.Hello("e"), wire.RdmaConnect("e", [wire.QPInfo(1, 2, 3, b"g" * 16, 1024)]),
    wire.RdmaAccept([wire.QPInfo(1, 2, 3, b"g", 4096)]), wire.ControlError("x")]]
DESCRIPTOR_SEEDS = [SegmentDescriptor("s", "e", "h", 1, 2, ("tcp", "shm"), "id", 3, "/p", RdmaEndpoint(1, 2),
                                      5).to_bytes()]


def _control(data: bytes) -> None:
    try:
        wire.CONTROL_DECODER.decode(data)
    except msgspec.DecodeError:  # transfer.tcp_server._control turns it into a ControlError reply
        pass


def _descriptor(data: bytes) -> None:
    try:
        SegmentDescriptor.from_bytes(data)
    except TransferError:
        pass


def _transfer_headers(data: bytes) -> None:
    """The fixed request/response headers: any 36/24 bytes unpack; the server's checks on them
    (magic, version, MAX_FRAME, MAX_CONTROL) are what bound what it reads next."""
    data = data.ljust(wire.REQ.size, b"\0")
    magic, version, opcode, _, seg_id, req_id, offset, length = wire.REQ.unpack_from(data)
    assert 0 <= length < 1 << 64
    data = data.ljust(wire.RESP.size, b"\0")
    wire.RESP.unpack_from(data)


# The auth handshake (transfer/auth.py) over a socketpair: the peer's bytes are all sent, then
# its write side shut, so every read ends in bytes or EOF. A handshake ends in AuthError or, for a
# proof no one can make without the secret and the fresh nonce, never in success.
AUTH_SECRETS = {"alice": b"s" * 32}
AUTH_HELLO_SEEDS = [auth.MAGIC + bytes([5]) + b"alice" + bytes(range(32)) + b"p" * 32,
                    auth.MAGIC + bytes([3]) + b"bob" + b"n" * 32, auth.MAGIC + bytes([2]) + b"\xff\xfe" + b"n" * 64]
AUTH_REPLY_SEEDS = [bytes([auth.OK]) + b"n" * 32 + b"p" * 32 + bytes([auth.OK, 0]),
                    bytes([auth.OK]) + b"n" * 64 + bytes([auth.REFUSED, 7]) + b"refused",
                    bytes([auth.REFUSED]) + bytes(64), bytes([auth.NOT_CONFIGURED]) + bytes(64)]


def _peer(data: bytes) -> tuple[socket.socket, socket.socket]:
    mine, peer = socket.socketpair()
    peer.sendall(data)
    peer.shutdown(socket.SHUT_WR)
    return mine, peer


def _auth_serve(data: bytes) -> None:
    first = data[:len(auth.MAGIC)]
    if not auth.looks_like_hello(first):  # the ports answer anything else as their own protocol
        return
    for lookup in (AUTH_SECRETS.get, None):
        mine, peer = _peer(data[len(first):])
        try:
            auth.serve_handshake(mine, first, lookup, "rpc", timeout=1.0)
            raise AssertionError("a handshake with no valid proof succeeded")
        except auth.AuthError:
            pass
        finally:
            mine.close()
            peer.close()


def _auth_client(data: bytes) -> None:
    mine, peer = _peer(data)
    try:
        auth.client_handshake(mine, "alice", AUTH_SECRETS["alice"], "rpc", timeout=1.0)
        raise AssertionError("the client accepted a server proof made without the secret")
    except auth.AuthError:
        pass
    finally:
        mine.close()
        peer.close()


LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_dim=8, dtype="float16", chunk_tokens=4)
CHUNK_SEEDS = [bytes(encode_chunk(LAYOUT, np.zeros(LAYOUT.shape(t), "float16"), t, key=key))
               for t, key in ((1, None), (4, None), (4, "k"))]
CHUNK_SEEDS.append(CHUNK_SEEDS[0][:4] + (1).to_bytes(2, "little") + CHUNK_SEEDS[0][6:])  # a format-1 header


def _chunk(data: bytes) -> None:
    for verify in (True, False):
        try:
            view = decode_chunk(data, LAYOUT, verify=verify)
            view.as_numpy()  # a chunk that decodes must be readable as its layout says
        except KVPoolError:  # FormatError, ChecksumMismatch, LayoutMismatch
            pass
    try:
        read_header(data)
    except KVPoolError:
        pass


def _handle(data: bytes) -> None:
    try:
        KVHandle.from_json(data)
    except KVPoolError:  # InvalidArgument
        pass


HANDLE_SEEDS = [KVHandle(namespace="0" * 32, request_id="r", num_tokens=5, chunk_tokens=4, chunk_keys=["k"],
                         tail_key="tail/r", token_ids=[1, 2, 3, 4, 5]).to_json()]

WORKER_TYPES = [worker_api.TokenizeRequest, worker_api.PrefillRequest, worker_api.PrefillResponse,
                worker_api.DecodeRequest, worker_api.GenerateRequest, worker_api.TokenEvent, worker_api.LoadReport,
                worker_api.WorkerInfo, worker_api.TokenizerInfo, worker_api.EventsResponse]
WORKER_SEEDS = [b'{"v":1,"prompt":"hi"}', b'{"v":1,"messages":[{"role":"user","content":"x"}]}',
                b'{"v":1,"token_ids":[1,2,3],"request_id":"r","sampling":{"temperature":0.5,"top_p":0.9,"seed":3}}',
                b'{"v":1,"request_id":"r","index":0,"token_id":5,"done":true,"error":{"code":"x","message":"y"}}',
                b'{"v":1,"role":"prefill","queue_length":1,"active_sequences":0,"kv_tokens":0,"cache_tokens":0,'
                b'"cache_capacity_tokens":0,"max_batch":4}']


def _worker(data: bytes) -> None:
    for type_ in WORKER_TYPES:
        try:
            worker_api.decode(data, type_)
        except KVPoolError:  # InvalidArgument: the worker answers 400
            pass


# The SSD tier's meta record: <4sHHQQ magic, version, key_len, length, checksum> + key bytes.
from kvpool.tiers.ssd import MAGIC as SSD_MAGIC, META, VERSION as SSD_VERSION, SsdTier  # noqa: E402

SSD_SEEDS = [META.pack(SSD_MAGIC, SSD_VERSION, 3, 10, 99) + b"abc", META.pack(SSD_MAGIC, SSD_VERSION, 0, 0, 0)]


def _ssd_meta(data: bytes) -> None:
    parsed = SsdTier._parse_meta(memoryview(data))
    if parsed is not None:
        key, length, checksum = parsed
        assert check_stored_key(key) == key and length >= 0 and checksum >= 0  # a key a put could have written


TARGETS = {
    "rpc.request": (fuzz_bytes(REQUEST_SEEDS), _msgspec_only(request_decoder)),
    "rpc.reply": (fuzz_bytes(REPLY_SEEDS), _msgspec_only(reply_decoder)),
    "transfer.control": (fuzz_bytes(CONTROL_SEEDS), _control),
    "transfer.descriptor": (fuzz_bytes(DESCRIPTOR_SEEDS), _descriptor),
    "transfer.headers": (st.binary(max_size=48), _transfer_headers),
    "transfer.auth.serve": (fuzz_bytes(AUTH_HELLO_SEEDS, max_size=128), _auth_serve),
    "transfer.auth.client": (fuzz_bytes(AUTH_REPLY_SEEDS, max_size=128), _auth_client),
    "chunk_format": (fuzz_bytes(CHUNK_SEEDS, max_size=1024), _chunk),
    "handle.KVHandle": (fuzz_bytes(HANDLE_SEEDS), _handle),
    "worker_api": (fuzz_bytes(WORKER_SEEDS), _worker),
    "tiers.ssd.meta": (fuzz_bytes(SSD_SEEDS, max_size=64), _ssd_meta),
}
# The valid encodings each target's mutations start from (tests/fuzz/atheris_targets.py seeds its
# corpora with them too).
SEEDS = {"rpc.request": REQUEST_SEEDS, "rpc.reply": REPLY_SEEDS, "transfer.control": CONTROL_SEEDS,
         "transfer.descriptor": DESCRIPTOR_SEEDS, "transfer.auth.serve": AUTH_HELLO_SEEDS,
         "transfer.auth.client": AUTH_REPLY_SEEDS, "chunk_format": CHUNK_SEEDS, "handle.KVHandle": HANDLE_SEEDS,
         "worker_api": WORKER_SEEDS, "tiers.ssd.meta": SSD_SEEDS}


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_decoder_fuzz(target):
    strategy, check = TARGETS[target]
    run(target, strategy, check, EXAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_decoder_fuzz_long(target):
    strategy, check = TARGETS[target]
    run(target + " (long)", strategy, check, LONG_EXAMPLES)


# ---- codec payload decoders ------------------------------------------------------------------

def _codec_targets():
    from kvpool.codec import CODECS
    return sorted(CODECS)


def codec_target(name: str):
    """(a chunk object the codec encoded, the largest payload it encodes 4 tokens to, the check)."""
    import numpy as np
    import torch

    from kvpool.codec import get_codec

    codec = get_codec(name)
    layout = KVLayout(num_layers=2, kv_heads=2, head_dim=8, dtype="bfloat16", chunk_tokens=4, codec=name)
    kv = torch.from_numpy(np.random.default_rng(1).standard_normal(layout.shape(4)).astype("float32")).to(torch.bfloat16)
    seed = bytes(encode_chunk(layout, kv, codec=codec))

    def check(data: bytes) -> None:
        tokens = 4
        out = torch.empty(layout.shape(tokens), dtype=torch.bfloat16)
        try:
            codec.decode_into(layout, data, out)
        except KVPoolError:  # FormatError (CorruptObject): the reader's miss
            pass
        try:
            decode_chunk(data, layout, verify=False, codec=codec)
        except KVPoolError:
            pass

    return seed, codec.max_encoded_nbytes(layout, 4), check


def _codec_check(name: str):
    from kvpool.chunk_format import HEADER_SIZE

    seed, payload_max, check = codec_target(name)
    strategy = st.one_of(fuzz_bytes([seed[HEADER_SIZE:]], max_size=payload_max + 8), fuzz_bytes([seed], max_size=64),
                         st.binary(min_size=payload_max, max_size=payload_max))
    return strategy, check


@pytest.mark.parametrize("name", _codec_targets())
def test_codec_payload_fuzz(name):
    pytest.importorskip("torch")
    strategy, check = _codec_check(name)
    run(f"codec.{name}", strategy, check, EXAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("name", _codec_targets())
def test_codec_payload_fuzz_long(name):
    pytest.importorskip("torch")
    strategy, check = _codec_check(name)
    run(f"codec.{name} (long)", strategy, check, LONG_EXAMPLES)


# ---- the lmdb record reader, on a real lmdb file with damaged records ------------------------

def _ssd_reopen(records: list[tuple[bytes, bytes, bytes | None]]) -> None:
    """Write raw (lmdb key, meta record, data record) triples into a tier's lmdb, reopen it: the
    tier opens (dropping what does not parse), and every key it kept reads back or misses."""
    import lmdb

    with tempfile.TemporaryDirectory() as path:
        SsdTier(path, 1 << 20).close()
        env = lmdb.open(path, map_size=(1 << 20) * 2 + (64 << 20), max_dbs=2)
        meta_db, data_db = env.open_db(b"meta"), env.open_db(b"data")
        with env.begin(write=True) as txn:
            for lkey, meta, data in records:
                txn.put(lkey, meta, db=meta_db)
                if data is not None:
                    txn.put(lkey, data, db=data_db)
        env.close()
        tier = SsdTier(path, 1 << 20)
        try:
            for key, _ in list(tier.keys()):
                tier.get(key)
        finally:
            tier.close()


def _ssd_records():
    from kvpool.tiers.ssd import _lmdb_key
    import xxhash

    def good(key: str, data: bytes):
        kb = key.encode()
        return (_lmdb_key(key), META.pack(SSD_MAGIC, SSD_VERSION, len(kb), len(data), xxhash.xxh3_64_intdigest(data)) + kb,
                data)

    record = st.one_of(
        st.tuples(st.binary(min_size=1, max_size=16), fuzz_bytes(SSD_SEEDS, max_size=64),
                  st.none() | st.binary(max_size=32)),
        st.builds(good, st.text(min_size=1, max_size=8), st.binary(max_size=32)),
        st.builds(lambda r, d: (r[0], r[1], d), st.builds(good, st.text(min_size=1, max_size=8), st.binary(max_size=32)),
                  st.binary(max_size=32)),  # meta and data disagree
    )
    return st.lists(record, max_size=4)


def test_ssd_records_fuzz():
    run("tiers.ssd.recover", _ssd_records(), _ssd_reopen, max(20, EXAMPLES // 6))


@pytest.mark.slow
def test_ssd_records_fuzz_long():
    run("tiers.ssd.recover (long)", _ssd_records(), _ssd_reopen, LONG_EXAMPLES // 10)
