"""Codecs in the chunk format and the adapters' chunk store/reader: the codec is part of the layout
hash and the namespace, the header records its id, a chunk of another codec is a miss (even
under a forged key), and a save/load through a real embedded pool decodes within the bound."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvpool.chunk_format import HEADER, HEADER_SIZE, KVLayout, decode_chunk, encode_chunk, read_header, seal_into
from kvpool.codec import get_codec
from kvpool.errors import ChecksumMismatch, InvalidArgument, LayoutMismatch
from kvpool.keys import Namespace, chunk_keys_hex

LAYOUT = KVLayout(4, 2, 8, "bfloat16", 16)
LOSSY = ["int8", "fp8", "int8+zstd", "fp8+zstd"]


def kv_of(layout: KVLayout, tokens: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(layout.shape(tokens), generator=gen) * torch.logspace(-1, 1, layout.head_dim)
    return x.to(torch.bfloat16)


def within_bound(codec, layout, kv, out) -> bool:
    return bool(((out.double() - kv.double()).abs() <= codec.error_bound(layout, kv)).all())


def test_codec_is_part_of_layout_hash_and_namespace():
    assert "codec" not in LAYOUT.canonical()  # uncompressed layouts hash (and key) as they always did
    hashes = {replace(LAYOUT, codec=c).layout_hash for c in ["none", "int8", "fp8", "int8+zstd"]}
    assert len(hashes) == 4
    ns = Namespace("m", "f" * 32, LAYOUT)
    ns8 = replace(ns, layout=replace(LAYOUT, codec="int8"))
    assert ns.hex() != ns8.hex()
    ids = list(range(40))
    assert not set(chunk_keys_hex(ns.digest(), ids, 16)) & set(chunk_keys_hex(ns8.digest(), ids, 16))
    with pytest.raises(InvalidArgument):
        KVLayout(4, 2, 8, "bfloat16", 16, "")


@pytest.mark.parametrize("name", ["none+zstd", *LOSSY])
def test_encoded_object_round_trip_and_header(name):
    codec = get_codec(name)
    layout = replace(LAYOUT, codec=name)
    for tokens in (16, 5):
        kv = kv_of(layout, tokens)
        obj = encode_chunk(layout, kv, codec=codec)
        assert read_header(obj).flags == codec.codec_id  # the header records the codec
        view = decode_chunk(obj, layout, codec=codec)
        assert view.tokens == tokens and view.as_torch().dtype == torch.bfloat16
        if codec.lossless:
            assert torch.equal(view.as_torch(), kv)
        else:
            assert within_bound(codec, layout, kv, view.as_torch())
            if codec.fixed_rate:  # zstd frames cost more than they save on a payload this tiny
                assert len(obj) - HEADER_SIZE < 0.7 * LAYOUT.payload_nbytes(tokens)  # codes + this layout's scales
        k, v = view.layer(2)  # numpy views of the decoded KV (bfloat16 as uint16)
        assert (k.view("uint16") == view.as_torch()[2, 0].view(torch.int16).numpy().view("uint16")).all()


def test_a_chunk_of_another_codec_is_a_layout_mismatch():
    kv = kv_of(LAYOUT, 16)
    objects = {"none": bytes(encode_chunk(LAYOUT, kv, codec=get_codec("none")))}
    for name in LOSSY:
        objects[name] = bytes(encode_chunk(replace(LAYOUT, codec=name), kv, codec=get_codec(name)))
    for writer, obj in objects.items():
        for reader in objects:
            if reader != writer:
                with pytest.raises(LayoutMismatch):
                    decode_chunk(obj, replace(LAYOUT, codec=reader), codec=get_codec(reader))


def test_forged_layout_hash_is_still_caught_by_the_codec_id():
    """An int8 object whose header claims the uncompressed layout (a confused or lying writer)."""
    forged = bytearray(encode_chunk(replace(LAYOUT, codec="int8"), kv_of(LAYOUT, 16), codec=get_codec("int8")))
    fields = list(HEADER.unpack_from(forged, 0))
    fields[3] = LAYOUT.layout_hash
    HEADER.pack_into(forged, 0, *fields)
    with pytest.raises(LayoutMismatch, match="codec id 1"):
        decode_chunk(forged, LAYOUT)
    fields[5] = 0  # and with the codec id wiped too, the payload size gives it away
    HEADER.pack_into(forged, 0, *fields)
    with pytest.raises(Exception, match="payload"):
        decode_chunk(forged, LAYOUT)


def test_codec_layouts_need_their_codec():
    layout = replace(LAYOUT, codec="int8")
    obj = encode_chunk(layout, kv_of(layout, 16), codec=get_codec("int8"))
    with pytest.raises(InvalidArgument):
        decode_chunk(obj, layout)
    with pytest.raises(InvalidArgument):
        decode_chunk(obj, layout, codec=get_codec("fp8"))
    with pytest.raises(InvalidArgument):
        encode_chunk(LAYOUT, kv_of(LAYOUT, 16), codec=get_codec("int8"))
    with pytest.raises(InvalidArgument):  # a raw payload cannot be sealed as an int8 chunk by mistake
        seal_into(bytearray(LAYOUT.object_nbytes(16)), layout, 16)


def test_damaged_encoded_chunk_is_a_checksum_mismatch():
    layout = replace(LAYOUT, codec="int8")
    obj = encode_chunk(layout, kv_of(layout, 16), codec=get_codec("int8"))
    obj[HEADER_SIZE + 3] ^= 0x10
    with pytest.raises(ChecksumMismatch):
        decode_chunk(obj, layout, codec=get_codec("int8"))


@pytest.fixture
def pool():
    import kvpool
    from kvpool.config import load_settings
    from kvpool.embedded import EmbeddedPool

    with EmbeddedPool(load_settings(port=0, admin_port=0, dram_capacity="64MiB")) as ep:
        client = kvpool.connect(ep.address)
        try:
            yield client
        finally:
            client.close()


def _save(store, ids: list[int], kv: torch.Tensor, request_id: str | None = None):
    keys, planned, tail = store.plan_save(ids, request_id=request_id)
    for obj in planned:
        chunk = kv[:, :, :, obj.start:obj.start + obj.tokens].contiguous()
        memoryview(obj.buffer)[HEADER_SIZE:] = chunk.view(torch.int16).numpy().tobytes()
    return store.store(keys, planned, tail, len(ids))


def test_stores_of_two_codecs_never_read_each_others_chunks(pool):
    from engine_adapters.chunk_store import ChunkStore

    ns = Namespace("m", "f" * 32, LAYOUT)
    none = ChunkStore(pool, ns)
    int8 = ChunkStore(pool, replace(ns, layout=replace(LAYOUT, codec="int8")))
    ids = list(range(1000, 1040))  # two full chunks and a tail
    kv = kv_of(LAYOUT, 40)
    saved = _save(int8, ids, kv, request_id="r8")
    assert saved.stored_chunks == 2
    assert int8.lookup(ids) == 32 and none.lookup(ids) == 0  # other keys: not even a match
    views = int8.reader.run(saved.keys)
    codec = get_codec("int8")
    assert len(views) == 2
    for i, view in enumerate(views):
        assert within_bound(codec, int8.layout, kv[:, :, :, 16 * i:16 * (i + 1)].contiguous(), view.as_torch())
    tail = int8.reader.exact([saved.tail_key], [8])[0].as_torch()
    assert within_bound(codec, int8.layout, kv[:, :, :, 32:].contiguous(), tail)
    # what the pool holds is the int8 object (codes and scales: ~0.6 of bfloat16 at head dim 8), its codec id in the header
    blob = pool.get(saved.keys[0])
    assert read_header(blob).flags == 1 and len(blob) - HEADER_SIZE < 0.6 * LAYOUT.payload_nbytes(16)

    # the uncompressed store saves its own copy under its own keys; each reads back its own
    plain = _save(none, ids, kv)
    assert plain.stored_chunks == 2 and not set(plain.keys) & set(saved.keys)
    assert torch.equal(torch.cat([v.as_torch() for v in none.reader.run(plain.keys)], dim=3), kv[:, :, :, :32])

    # an int8 object under an uncompressed key (forged): a miss for the reader, left in the pool (it
    # names another namespace and key, so it is not provably the reader's to remove: chunk_reader)
    pool.remove(plain.keys[0])
    pool.put(plain.keys[0], blob)
    assert none.reader.run(plain.keys) == []
    assert none.reader.damaged == none.reader.rejected == 1 and pool.exists(plain.keys[0])
