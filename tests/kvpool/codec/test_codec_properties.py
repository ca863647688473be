"""Hypothesis-generated tensors through every codec: any layout (odd shapes included), any token
count, values over many decades with zeros and sign changes: the round trip stays within the
codec's stated bound (bit-exact when lossless), the bound is not vacuous, and a payload cut
anywhere is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kvpool.codec import CODECS, decode, encode, get_codec
from kvpool.codec._tensors import TORCH_DTYPES
from kvpool.errors import FormatError, Unavailable
from kvpool.chunk_format import KVLayout


def codec_or_skip(name: str):
    try:
        return get_codec(name)
    except Unavailable as exc:
        pytest.skip(str(exc))


@st.composite
def layouts_and_kv(draw):
    dtype = draw(st.sampled_from(["float32", "bfloat16", "float16"]))
    layers, heads, head_dim = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 9))
    chunk = draw(st.integers(1, 12))
    tokens = draw(st.integers(1, chunk))
    layout = KVLayout(layers, heads, head_dim, dtype, chunk)
    limit = 6e4 if dtype == "float16" else 1e6
    values = arrays(np.float32, layout.shape(tokens),
                    elements=st.floats(-limit, limit, width=32, allow_nan=False, allow_subnormal=False))
    magnitudes = arrays(np.float32, (layers, 2, heads, 1, head_dim), elements=st.sampled_from([1e-4, 1e-2, 1.0, 1.0, 1.0]))
    x = draw(values) * draw(magnitudes)
    return layout, torch.from_numpy(x).to(TORCH_DTYPES[dtype])


@pytest.mark.parametrize("name", list(CODECS))
@settings(max_examples=40, deadline=None)
@given(case=layouts_and_kv(), cut=st.integers(1, 1 << 20))
def test_round_trip_and_truncation(name, case, cut):
    codec = codec_or_skip(name)
    layout, kv = case
    tokens = kv.shape[3]
    payload = encode(codec, layout, kv)
    out = decode(codec, layout, payload, tokens)
    if codec.lossless:
        assert torch.equal(out.view(torch.uint8), kv.view(torch.uint8))
    else:
        x = kv.to(torch.float64)
        err = (out.to(torch.float64) - x).abs()
        bound = codec.error_bound(layout, kv)
        assert bool((err <= bound).all()), float((err - bound).max())
        # not vacuous: within 1/15 of the largest magnitude in the chunk (fp8: 1/16, int8: 1/254)
        assert float(bound.max()) <= x.abs().max().item() / 15 + 1e-6
    with pytest.raises(FormatError):
        decode(codec, layout, bytes(payload[:max(0, len(payload) - cut)]), tokens)
