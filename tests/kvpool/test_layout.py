"""Chunk object format: committed golden bytes, roundtrips, and damaged objects never decoding
into wrong data (hypothesis)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.errors import ChecksumMismatch, CorruptObject, FormatError, InvalidArgument, LayoutMismatch, UntrustedChunk
from kvpool.chunk_format import (FLAG_MAC, HEADER_SIZE, ChunkAuth, KVLayout, decode_chunk, encode_chunk, key_digest,
                                 payload_tensor, read_header, seal_into)

GOLDEN = json.loads((Path(__file__).parent / "golden" / "vectors.json").read_text())["layout"]
SMALL = KVLayout(num_layers=2, kv_heads=1, head_dim=4, dtype="float32", chunk_tokens=4)


def _golden_values(spec: dict, tokens: int):
    lay = KVLayout(**spec)
    vals = np.arange(np.prod(lay.shape(tokens)), dtype=np.float64).reshape(lay.shape(tokens)) * 0.25 - 3
    return torch.from_numpy(vals).to(torch.bfloat16) if spec["dtype"] == "bfloat16" else vals.astype(spec["dtype"])


@pytest.mark.parametrize("case", GOLDEN["hashes"], ids=lambda c: c["layout"]["dtype"])
def test_layout_hash_golden(case):
    lay = KVLayout(**case["layout"])
    assert lay.layout_hash == case["layout_hash"]
    assert lay.bytes_per_token == case["bytes_per_token"]


@pytest.mark.parametrize("case", GOLDEN["chunks"], ids=lambda c: f"{c['layout']['dtype']}-{c['tokens']}")
def test_chunk_golden(case):
    """Version 2: bound to a key and a namespace, MACed (BLAKE3 keyed) under a fixed test key."""
    lay = KVLayout(**case["layout"])
    kv = _golden_values(case["layout"], case["tokens"])
    auth = ChunkAuth(bytes.fromhex(case["namespace_hex"]), bytes.fromhex(case["mac_key_hex"]))
    encoded = bytes(encode_chunk(lay, kv, case["tokens"], key=case["key"], auth=auth))
    assert encoded.hex() == case["encoded_hex"]
    # The header, read by hand from the documented table.
    magic, version, hlen, lhash, tokens, flags, nbytes, checksum, ns, kd = struct.unpack_from("<4sHHQIIQQ16s16s", encoded)
    assert (magic, version, hlen, tokens, flags) == (b"KVPC", 2, 128, case["tokens"], 1 << 8)
    assert lhash == lay.layout_hash and nbytes == len(encoded) - 128
    assert checksum == xxhash.xxh3_64_intdigest(encoded[128:]) and encoded[72:96] == bytes(24)
    assert ns == auth.namespace and kd == key_digest(case["key"])
    from blake3 import blake3
    assert encoded[96:128] == blake3(encoded[:96] + encoded[128:], key=auth.mac_key).digest()
    view = decode_chunk(bytes.fromhex(case["encoded_hex"]), lay, key=case["key"], auth=auth)
    assert view.tokens == case["tokens"]
    if case["layout"]["dtype"] == "bfloat16":
        assert torch.equal(view.as_torch(), kv)
    else:
        np.testing.assert_array_equal(view.as_numpy(), kv)
        k0, v0 = view.layer(0)
        np.testing.assert_array_equal(k0, kv[0, 0])


dtypes = st.sampled_from(["float32", "float16"])


@settings(max_examples=100, deadline=None)
@given(layers=st.integers(1, 3), heads=st.integers(1, 3), dim=st.integers(1, 8), chunk=st.integers(1, 6),
       dtype=dtypes, data=st.data())
def test_roundtrip(layers, heads, dim, chunk, dtype, data):
    lay = KVLayout(layers, heads, dim, dtype, chunk)
    tokens = data.draw(st.integers(1, chunk))
    seed = data.draw(st.integers(0, 2**32 - 1))
    kv = np.random.default_rng(seed).standard_normal(lay.shape(tokens)).astype(dtype)
    obj = encode_chunk(lay, kv)
    assert len(obj) == lay.object_nbytes(tokens)
    np.testing.assert_array_equal(decode_chunk(obj, lay).as_numpy(), kv)
    assert encode_chunk(lay, torch.from_numpy(kv), tokens) == obj
    out = bytearray(len(obj) + 7)  # an in-place writer's buffer, larger than the object
    payload_tensor(out, lay, tokens).copy_(torch.from_numpy(kv))
    assert seal_into(out, lay, tokens) == len(obj)
    assert bytes(out[: len(obj)]) == bytes(obj)


SMALL_AUTH = ChunkAuth(b"n" * 16)
SMALL_KEYED = ChunkAuth(b"n" * 16, b"k" * 32)


@settings(max_examples=300, deadline=None)
@given(pos=st.integers(0, SMALL.object_nbytes() - 1), flip=st.integers(1, 255), keyed=st.booleans())
def test_corrupt_byte_never_decodes_to_wrong_data(pos, flip, keyed):
    kv = np.arange(np.prod(SMALL.shape(4)), dtype=np.float32).reshape(SMALL.shape(4))
    auth = SMALL_KEYED if keyed else SMALL_AUTH
    obj = encode_chunk(SMALL, kv, key="k", auth=auth)
    obj[pos] ^= flip
    try:
        view = decode_chunk(obj, SMALL, key="k", auth=auth)
    except (CorruptObject, LayoutMismatch) as exc:
        if pos >= HEADER_SIZE:  # payload damage is caught by the MAC, or by the checksum without one
            assert isinstance(exc, UntrustedChunk if keyed else ChecksumMismatch)
        return
    # With a MAC every byte is load-bearing. Without one, the reserved bytes and the tag are not, nor
    # the flag saying the tag is a MAC (bit 8, byte 21): a reader without the key checks the binding
    # and the checksum alone, so a chunk flagged as MAC'd reads the same to it (and the data is right).
    assert not keyed and (72 <= pos < HEADER_SIZE or (pos == 21 and flip == FLAG_MAC >> 8))
    np.testing.assert_array_equal(view.as_numpy(), kv)


@settings(max_examples=100, deadline=None)
@given(cut=st.integers(0, SMALL.object_nbytes() - 1))
def test_truncated_is_format_error(cut):
    obj = encode_chunk(SMALL, np.zeros(SMALL.shape(4), np.float32))
    with pytest.raises(FormatError):
        decode_chunk(bytes(obj[:cut]), SMALL)


def test_header_damage_is_typed():
    obj = encode_chunk(SMALL, np.zeros(SMALL.shape(4), np.float32), key="k", auth=SMALL_AUTH)
    for pos, exc in ((0, FormatError), (4, FormatError), (6, FormatError), (8, LayoutMismatch),
                     (16, FormatError), (22, FormatError), (24, FormatError), (32, ChecksumMismatch),
                     (40, UntrustedChunk), (56, UntrustedChunk)):
        bad = bytearray(obj)
        bad[pos] ^= 0x40
        with pytest.raises(exc):
            decode_chunk(bad, SMALL, key="k", auth=SMALL_AUTH)
    with pytest.raises(FormatError):
        read_header(b"KVPC")


def test_binding_and_mac():
    kv = np.ones(SMALL.shape(4), np.float32)
    keyed = encode_chunk(SMALL, kv, key="k", auth=SMALL_KEYED)
    np.testing.assert_array_equal(decode_chunk(keyed, SMALL, key="k", auth=SMALL_KEYED).as_numpy(), kv)
    refusals = [dict(key="other", auth=SMALL_KEYED),  # a valid chunk copied under another key
                dict(key="k", auth=ChunkAuth(b"m" * 16, b"k" * 32)),  # another namespace (tenant)
                dict(key="k", auth=ChunkAuth(b"n" * 16, b"x" * 32))]  # another tenant's MAC key
    for kw in refusals:
        with pytest.raises(UntrustedChunk):
            decode_chunk(keyed, SMALL, **kw)
    # an unkeyed chunk, however well bound, is refused by a keyed reader; an unkeyed reader reads both
    plain = encode_chunk(SMALL, kv, key="k", auth=SMALL_AUTH)
    with pytest.raises(UntrustedChunk, match="no MAC"):
        decode_chunk(plain, SMALL, key="k", auth=SMALL_KEYED)
    assert decode_chunk(keyed, SMALL, key="k", auth=SMALL_AUTH).tokens == 4
    # a writer without the key cannot fix up the checksum and pass: the MAC covers the header too
    forged = bytearray(keyed)
    forged[HEADER_SIZE] ^= 1
    forged[32:40] = xxhash.xxh3_64_intdigest(bytes(forged[HEADER_SIZE:])).to_bytes(8, "little")
    with pytest.raises(UntrustedChunk, match="checksum intact"):
        decode_chunk(forged, SMALL, key="k", auth=SMALL_KEYED)
    with pytest.raises(InvalidArgument):
        ChunkAuth(b"n" * 16, b"short")


def test_version_1_is_a_clean_miss():
    v1 = struct.pack("<4sHHQIIQQ24x", b"KVPC", 1, 64, SMALL.layout_hash, 4, 0, SMALL.payload_nbytes(4), 0)
    with pytest.raises(FormatError, match="version 1"):
        decode_chunk(v1 + bytes(SMALL.payload_nbytes(4)), SMALL)


def test_bad_encode_input():
    with pytest.raises(InvalidArgument):
        encode_chunk(SMALL, np.zeros((2, 2, 1, 4, 5), np.float32))  # wrong shape
    with pytest.raises(InvalidArgument):
        encode_chunk(SMALL, np.zeros((2, 2, 1, 4, 4), np.float64))  # wrong dtype size
    with pytest.raises(InvalidArgument):
        seal_into(bytearray(10), SMALL, 4)
    with pytest.raises(InvalidArgument):
        encode_chunk(SMALL, np.zeros(SMALL.shape(4), np.float32), tokens=5)
    with pytest.raises(InvalidArgument):
        KVLayout(0, 1, 1)
    with pytest.raises(InvalidArgument):
        KVLayout(1, 1, 1, dtype="int8")
