"""What a codec makes a token cost in the pool (`stored_bytes_per_token`, which workers report in
/v1/info and the router's fetch estimate uses), and `kvpool up --kv-codec`'s check of the name."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvpool.chunk_format import HEADER_SIZE, KVLayout, encode_chunk
from kvpool.codec import get_codec, stored_bytes_per_token

LAYOUT = KVLayout(30, 3, 64, "float32", 256)  # the reference model's


def test_none_stores_the_kv_bytes():
    assert stored_bytes_per_token(LAYOUT) == LAYOUT.bytes_per_token


@pytest.mark.parametrize("codec", ["int8", "fp8"])
def test_a_fixed_rate_codec_stores_what_its_chunks_hold(codec):
    layout = KVLayout(30, 3, 64, "float32", 256, codec)
    kv = torch.randn(layout.shape(256))
    stored = len(encode_chunk(layout, kv, codec=get_codec(codec))) - HEADER_SIZE
    assert stored_bytes_per_token(layout) == -(-stored // 256)
    assert 0.25 <= stored_bytes_per_token(layout) / LAYOUT.bytes_per_token <= 0.26  # a quarter of float32, plus scales


def test_a_variable_rate_codec_reports_its_bound():
    pytest.importorskip("zstandard")
    layout = KVLayout(30, 3, 64, "float32", 256, "int8+zstd")
    assert stored_bytes_per_token(layout) >= stored_bytes_per_token(KVLayout(30, 3, 64, "float32", 256, "int8"))


def test_kvpool_up_refuses_an_unknown_codec_before_starting_anything(tmp_path):
    run = subprocess.run([sys.executable, "-c", "from kvpool.cli import main; main()", "up", "--kv-codec", "zip9",
                          "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "unknown KV codec 'zip9'" in run.stderr and "Traceback" not in run.stderr
    assert not list(tmp_path.iterdir()), "no process was started"
