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

from kvpool.errors import ChecksumMismatch, CorruptObject, FormatError, InvalidArgument, LayoutMismatch
from kvpool.chunk_format import HEADER_SIZE, KVLayout, decode_chunk, encode_chunk, encode_into, read_header

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
    lay = KVLayout(**case["layout"])
    kv = _golden_values(case["layout"], case["tokens"])
    encoded = bytes(encode_chunk(lay, kv, case["tokens"]))
    assert encoded.hex() == case["encoded_hex"]
    # The header, read by hand from the documented table.
    magic, version, hlen, lhash, tokens, flags, nbytes, checksum = struct.unpack_from("<4sHHQIIQQ", encoded)
    assert (magic, version, hlen, tokens, flags) == (b"KVPC", 1, 64, case["tokens"], 0)
    assert lhash == lay.layout_hash and nbytes == len(encoded) - 64
    assert checksum == xxhash.xxh3_64_intdigest(encoded[64:]) and encoded[40:64] == bytes(24)
    view = decode_chunk(bytes.fromhex(case["encoded_hex"]), lay)
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
    out = bytearray(len(obj) + 7)
    assert encode_into(out, lay, torch.from_numpy(kv), tokens) == len(obj)
    assert bytes(out[: len(obj)]) == bytes(obj)


@settings(max_examples=300, deadline=None)
@given(pos=st.integers(0, SMALL.object_nbytes() - 1), flip=st.integers(1, 255))
def test_corrupt_byte_never_decodes_to_wrong_data(pos, flip):
    kv = np.arange(np.prod(SMALL.shape(4)), dtype=np.float32).reshape(SMALL.shape(4))
    obj = encode_chunk(SMALL, kv)
    obj[pos] ^= flip
    try:
        view = decode_chunk(obj, SMALL)
    except (CorruptObject, LayoutMismatch) as exc:
        if pos >= HEADER_SIZE:
            assert isinstance(exc, ChecksumMismatch)  # payload damage is caught by the checksum
        return
    # Only the reserved / flags bytes are not load-bearing: the payload must then be intact.
    assert 20 <= pos < 24 or 40 <= pos < 64
    np.testing.assert_array_equal(view.as_numpy(), kv)


@settings(max_examples=100, deadline=None)
@given(cut=st.integers(0, SMALL.object_nbytes() - 1))
def test_truncated_is_format_error(cut):
    obj = encode_chunk(SMALL, np.zeros(SMALL.shape(4), np.float32))
    with pytest.raises(FormatError):
        decode_chunk(bytes(obj[:cut]), SMALL)


def test_header_damage_is_typed():
    obj = encode_chunk(SMALL, np.zeros(SMALL.shape(4), np.float32))
    for pos, exc in ((0, FormatError), (4, FormatError), (6, FormatError), (8, LayoutMismatch),
                     (16, FormatError), (24, FormatError), (32, ChecksumMismatch)):
        bad = bytearray(obj)
        bad[pos] ^= 0x40
        with pytest.raises(exc):
            decode_chunk(bad, SMALL)
    with pytest.raises(FormatError):
        read_header(b"KVPC")


def test_bad_encode_input():
    with pytest.raises(InvalidArgument):
        encode_chunk(SMALL, np.zeros((2, 2, 1, 4, 5), np.float32))  # wrong shape
    with pytest.raises(InvalidArgument):
        encode_chunk(SMALL, np.zeros((2, 2, 1, 4, 4), np.float64))  # wrong dtype size
    with pytest.raises(InvalidArgument):
        encode_into(bytearray(10), SMALL, np.zeros(SMALL.shape(4), np.float32), 4)
    with pytest.raises(InvalidArgument):
        encode_chunk(SMALL, np.zeros(SMALL.shape(4), np.float32), tokens=5)
    with pytest.raises(InvalidArgument):
        KVLayout(0, 1, 1)
    with pytest.raises(InvalidArgument):
        KVLayout(1, 1, 1, dtype="int8")
