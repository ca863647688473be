"""The conformance suite every KV codec runs (kvpool.codec): round trip within the codec's stated
bound (bit-exact for lossless codecs), sizes, dtypes, odd shapes, layer-wise decode, refusal of bad
input, and damaged payloads raising FormatError (a miss), never returning KV."""

from __future__ import annotations

import pytest
import torch
import xxhash

from kvpool.codec import CODECS, codec_name, decode, encode, get_codec
from kvpool.codec._tensors import TORCH_DTYPES
from kvpool.errors import CorruptObject, FormatError, InvalidArgument, Unavailable
from kvpool.chunk_format import KVLayout

DTYPES = ["float32", "bfloat16", "float16"]
SMOL = dict(num_layers=30, kv_heads=3, head_dim=64, chunk_tokens=256)  # the reference model's layout


def codec_or_skip(name: str):
    try:
        return get_codec(name)
    except Unavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(params=list(CODECS))
def codec(request):
    return codec_or_skip(request.param)


def kv_like(layout: KVLayout, tokens: int, seed: int = 0) -> torch.Tensor:
    """KV-shaped data with what real KV has: per-channel magnitudes over three decades (K's outlier
    channels), per-token magnitudes, a zero channel, both signs."""
    gen = torch.Generator().manual_seed(seed)
    shape = layout.shape(tokens)
    x = torch.randn(shape, generator=gen)
    channel = 10.0 ** (torch.rand(shape[0], 2, shape[2], 1, shape[4], generator=gen) * 3 - 1.5)
    token = 0.5 + torch.rand(shape[0], 2, shape[2], tokens, 1, generator=gen)
    x = x * channel * token
    x[..., 0] = 0.0
    return x.to(TORCH_DTYPES[layout.dtype])


def assert_round_trip(codec, layout: KVLayout, kv: torch.Tensor) -> torch.Tensor:
    before = kv.clone()
    payload = encode(codec, layout, kv)
    assert torch.equal(kv, before), "encoding modified its input"
    out = decode(codec, layout, payload, kv.shape[3])
    assert out.dtype == kv.dtype and out.shape == kv.shape
    if codec.lossless:
        assert torch.equal(out.view(torch.uint8), kv.contiguous().view(torch.uint8)), f"{codec.name} is not bit-exact"
    else:
        err = (out.to(torch.float64) - kv.to(torch.float64)).abs()
        bound = codec.error_bound(layout, kv)
        worst = (err - bound).max()
        assert bool((err <= bound).all()), f"{codec.name}: error exceeds its bound by {float(worst):g}"
    return out


def test_registry_names_and_ids_are_unique_and_stable():
    ids = [cid for cid, _ in CODECS.values()]
    assert len(set(ids)) == len(ids)
    assert (CODECS["none"][0], CODECS["int8"][0], CODECS["fp8"][0]) == (0, 1, 2)  # recorded in chunk headers
    for name, (cid, _) in CODECS.items():
        assert codec_name(cid) == name
    with pytest.raises(InvalidArgument, match="unknown KV codec"):
        get_codec("int3")
    with pytest.raises(InvalidArgument):
        codec_name(250)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 255, 256])
def test_round_trip_within_bound(codec, dtype, tokens):
    layout = KVLayout(dtype=dtype, **SMOL)
    assert_round_trip(codec, layout, kv_like(layout, tokens))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dims", [(1, 1, 1, 1, 1), (2, 1, 5, 7, 3), (3, 4, 7, 13, 13), (1, 2, 3, 1, 64)])
def test_odd_shapes(codec, dtype, dims):
    layers, heads, head_dim, chunk, tokens = dims
    layout = KVLayout(layers, heads, head_dim, dtype, chunk)
    assert_round_trip(codec, layout, kv_like(layout, min(tokens, chunk), seed=sum(dims)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fill", [0.0, 1.0, -3.5, 1e-3])
def test_constant_and_zero_groups(codec, dtype, fill):
    layout = KVLayout(2, 2, 8, dtype, 16)
    kv = torch.full(layout.shape(16), fill, dtype=TORCH_DTYPES[dtype])
    out = assert_round_trip(codec, layout, kv)
    if fill == 0.0:
        assert bool((out == 0).all()), "an all-zero chunk must decode to exact zeros"


def test_extreme_magnitudes_float32(codec):
    layout = KVLayout(2, 2, 8, "float32", 16)
    kv = kv_like(layout, 16)
    kv[0, 0, 0, :, 1] = 3e30  # one huge channel in K, one huge token in V
    kv[1, 1, 1, 5, :] = -2e-30
    assert_round_trip(codec, layout, kv)


def test_float16_extremes_stay_finite(codec):
    layout = KVLayout(1, 1, 4, "float16", 4)
    kv = torch.tensor([65504.0, -65504.0, 1.0, 0.0]).repeat(1, 2, 1, 4, 1).reshape(layout.shape(4)).half()
    out = assert_round_trip(codec, layout, kv)
    assert bool(torch.isfinite(out).all())


def test_sizes(codec):
    layout = KVLayout(dtype="bfloat16", **SMOL)
    for tokens in (1, 100, 256):
        payload = encode(codec, layout, kv_like(layout, tokens))
        assert len(payload) <= codec.max_encoded_nbytes(layout, tokens)
        if codec.fixed_rate:
            assert len(payload) == codec.max_encoded_nbytes(layout, tokens)
    full = len(encode(codec, layout, kv_like(layout, 256))) / layout.payload_nbytes(256)
    if codec.name == "none":
        assert full == 1.0
    if codec.name in ("int8", "fp8"):
        assert full == pytest.approx(1 / 2 + 1 / 512 + 1 / 128)  # codes + K scales + V scales, vs bf16
    if codec.name in ("int8+zstd", "fp8+zstd"):
        assert full < 0.51


@pytest.mark.parametrize("dtype", DTYPES)
def test_bad_input_is_refused(codec, dtype):
    layout = KVLayout(2, 2, 8, dtype, 16)
    kv = kv_like(layout, 4)
    other = "float16" if dtype != "float16" else "float32"
    with pytest.raises(InvalidArgument):
        encode(codec, layout, kv.to(TORCH_DTYPES[other]))
    with pytest.raises(InvalidArgument):
        encode(codec, layout, kv[:, :, :1])
    with pytest.raises(InvalidArgument):
        encode(codec, layout, kv_like(KVLayout(2, 2, 8, dtype, 32), 17))  # more tokens than a chunk
    with pytest.raises(InvalidArgument):
        encode(codec, layout, kv.numpy() if dtype != "bfloat16" else [1.0])
    if not codec.lossless:
        bad = kv.clone()
        bad[1, 1, 0, 2, 3] = float("nan")
        with pytest.raises(InvalidArgument, match="non-finite"):
            encode(codec, layout, bad)
        bad[1, 1, 0, 2, 3] = float("inf")
        with pytest.raises(InvalidArgument, match="non-finite"):
            encode(codec, layout, bad)


@pytest.mark.parametrize("cut", [1, 7, "half", "all"])
def test_truncated_or_extended_payload_is_a_format_error(codec, cut):
    layout = KVLayout(dtype="bfloat16", **SMOL)
    payload = bytes(encode(codec, layout, kv_like(layout, 64)))
    n = {"half": len(payload) // 2, "all": len(payload)}.get(cut, cut)
    for damaged in (payload[:-n], payload + b"\0" * (n if isinstance(n, int) and n < 8 else 1)):
        with pytest.raises(FormatError):
            decode(codec, layout, damaged, 64)
    assert issubclass(FormatError, CorruptObject)  # readers treat it as a miss


def test_payload_of_another_token_count_is_refused(codec):
    layout = KVLayout(dtype="float16", **SMOL)
    payload = encode(codec, layout, kv_like(layout, 64))
    with pytest.raises(FormatError):
        decode(codec, layout, payload, 63)


def _scale_offsets(layout: KVLayout, tokens: int) -> tuple[int, int]:
    """Offsets of the first K scale and the first V scale of layer 0 in a scaled codec's payload."""
    codes = 2 * layout.kv_heads * tokens * layout.head_dim
    return codes, codes + 2 * layout.kv_heads * layout.head_dim


@pytest.mark.parametrize("name", ["int8", "fp8"])
@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_damaged_scales_are_a_format_error(name, which, value):
    codec = get_codec(name)
    layout = KVLayout(2, 2, 8, "float32", 16)
    payload = encode(codec, layout, kv_like(layout, 16))
    k_off, v_off = _scale_offsets(layout, 16)
    off = k_off if which == "k" else v_off
    payload[off:off + 2] = torch.tensor([value], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    with pytest.raises(FormatError, match="scale"):
        decode(codec, layout, payload, 16)


def test_fp8_nan_code_is_a_format_error():
    codec = get_codec("fp8")
    layout = KVLayout(2, 2, 8, "bfloat16", 16)
    payload = encode(codec, layout, kv_like(layout, 16))
    payload[5] = 0x7F
    with pytest.raises(FormatError, match="NaN"):
        decode(codec, layout, payload, 16)


@pytest.mark.parametrize("name", ["none+zstd", "int8+zstd", "fp8+zstd"])
def test_damaged_zstd_frames_are_a_format_error(name):
    codec = codec_or_skip(name)
    layout = KVLayout(3, 2, 8, "bfloat16", 32)
    good = encode(codec, layout, kv_like(layout, 32))
    table = 4 * (1 + layout.num_layers)
    flipped = bytearray(good)
    for i in range(table + 4, len(good), 9):  # garbage inside the frames
        flipped[i] ^= 0xA5
    wrong_count = bytearray(good)
    wrong_count[0] = 7
    wrong_length = bytearray(good)
    wrong_length[4] += 1
    for damaged in (flipped, wrong_count, wrong_length, good[:table - 1]):
        with pytest.raises(FormatError):
            decode(codec, layout, damaged, 32)


# Payload bytes of a fixed input: a codec id means one byte format forever (chunks outlive builds).
GOLDEN = {"none": "155b78c630f801fb", "int8": "95b6d35dced085e3", "fp8": "726bffd177023b89"}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_payload_bytes_are_stable(name):
    layout = KVLayout(2, 2, 4, "bfloat16", 8)
    n = 2 * 2 * 2 * 8 * 4
    kv = ((torch.arange(n, dtype=torch.float32) * 0.37).sin() * torch.arange(n).remainder(5)).reshape(layout.shape(8))
    payload = encode(get_codec(name), layout, kv.to(torch.bfloat16))
    assert xxhash.xxh3_64_hexdigest(bytes(payload)) == GOLDEN[name]
