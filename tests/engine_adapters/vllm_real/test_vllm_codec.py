"""The connector's kv_codec in real vLLM engines (kept short: two fresh float32 engines and a
control): a kv_producer with `kv_codec: int8` stores int8 chunks, a fresh int8 kv_consumer loads
them, and a lossless consumer of the same model never does (the codec is in the namespace)."""

from __future__ import annotations

import importlib.util

import pytest

from kvpool.chunk_format import KVLayout, read_header
from kvpool.codec import get_codec
from kvpool.keys import Namespace, chunk_keys_hex

from test_vllm_real import CHUNK, MODEL_ID, connector, engine, loadable, run

# slow: three fresh engines (~1.5 min): the codec's own agreement is in the default suite and `kvpool bench codec`.
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed here: `make test` runs this suite in .venv-vllm")]


def test_int8_chunks_are_stored_loaded_and_never_read_by_a_lossless_engine(model_path, pool_address, pool, prompts):
    fingerprint = f"{model_path.name}-codec-test"  # apart from the other tests' chunks of the same prompts

    def conn(role, **extra):
        return {**connector(pool_address, model_path, role, **extra), "weights_fingerprint": fingerprint}

    first = prompts[:2]
    run(model_path, engine("producer8", "float32", first, connector=conn("kv_producer", kv_codec="int8"), max_tokens=1))
    ns = Namespace(MODEL_ID, fingerprint, KVLayout(30, 3, 64, "float32", CHUNK, "int8"))
    keys = chunk_keys_hex(ns.digest(), first[0], CHUNK)
    assert keys and all(pool.exists_batch(keys))
    assert read_header(pool.get(keys[0])).codec_id == get_codec("int8").codec_id

    out = run(model_path, engine("consumer8", "float32", first, connector=conn("kv_consumer", kv_codec="int8")),
              engine("consumer0", "float32", first, connector=conn("kv_consumer")))
    (got8, stats8), (got0, _) = out["consumer8"], out["consumer0"]
    assert got8["cached_tokens"] == [loadable(p) for p in first]
    assert stats8.get("load_errors", 0) == 0
    assert got0["cached_tokens"] == [0, 0], "a lossless engine never loads int8 chunks"
    same = sum(a == b for x, y in zip(got8["tokens"], got0["tokens"]) for a, b in zip(x, y))
    total = sum(len(x) for x in got0["tokens"])
    print(f"int8-loaded vs computed greedy tokens equal: {same}/{total}")
    assert same >= total // 2  # int8 agrees 0.994 teacher-forced in `kvpool bench codec`; a broken decode would not
