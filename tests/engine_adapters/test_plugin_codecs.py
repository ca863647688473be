"""The vLLM connector and the SGLang backend take the KV codec from their config (`kv_codec` in
`kv_connector_extra_config` / the HiCache `extra_config`): a plug-in with a codec encodes on save
and decodes on load, and never loads a chunk of a codec it was not configured for (the codec is
part of the layout, so of the namespace and of every chunk's header).

Real parts: the plug-ins, the codecs, the pool (embedded, on loopback); FAKE engines (vLLM's call
sequence, SGLang's host pool) from tests/engine_adapters/fakes.
"""

from __future__ import annotations

import pytest
import torch

from engine_adapters import sglang as backend_mod
from engine_adapters import vllm as conn
from engine_adapters.vllm.settings import ConnectorSettings
from fakes.sglang_api import FakeHiCacheStorageConfig
from fakes.sglang_host import FakeMHATokenToKVPoolHost
from fakes.vllm_engine import FakeRequest, FakeVllmEngine
from kvpool.chunk_format import KVLayout, decode_chunk, read_header
from kvpool.client import connect
from kvpool.codec import get_codec
from kvpool.config import load_settings
from kvpool.embedded import EmbeddedPool
from kvpool.errors import InvalidArgument, LayoutMismatch
from kvpool.keys import Namespace, chunk_keys_hex
from vllm_fake_support import CHUNK, DIM, HEADS, LAYERS, make_config, prompts


@pytest.fixture
def pool():
    server = EmbeddedPool(load_settings(port=0, admin_port=0, dram_capacity="64MiB")).start()
    client = connect(server.address)
    yield client
    client.close()
    server.stop()


def _close_enough(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within int8's bound: half a step of a scale no larger than the tensor's largest magnitude / 127
    (bf16 scales: a little over), never bit-exact by luck alone."""
    step = float(want.abs().max()) / 127
    return float((got.float() - want.float()).abs().max()) <= 0.6 * step * 1.01


# -- vLLM ------------------------------------------------------------------------------------------

def _vllm_keys(tokens, codec):
    layout = KVLayout(LAYERS, HEADS, DIM, "float16", CHUNK, codec)
    return chunk_keys_hex(Namespace("fake/model", "test-weights", layout).digest(), tokens, CHUNK)


def test_vllm_connector_with_a_codec_encodes_on_save_and_decodes_on_load(pool):
    eng = FakeVllmEngine(make_config("float16", kv_codec="int8"), conn.KVPoolConnector, client=pool)
    assert eng.worker.settings.layout.codec == "int8"
    p1, p2 = prompts()
    eng.add_request("r1", p1)
    eng.run()
    keys = _vllm_keys(p1, "int8")
    assert all(pool.exists(k) for k in keys) and not any(pool.exists(k) for k in _vllm_keys(p1, "none"))
    plain = KVLayout(LAYERS, HEADS, DIM, "float16", CHUNK)
    blob = pool.get(keys[0])
    assert read_header(blob).codec_id == get_codec("int8").codec_id
    assert len(blob) < plain.object_nbytes() * 0.6, "int8 halves float16 (plus scales)"
    with pytest.raises(LayoutMismatch):  # a lossless reader refuses it, whatever the key
        decode_chunk(blob, plain)

    eng.add_request("r2", p2)
    step = eng.step()
    assert step.matched == {"r2": 64} and not step.load_errors
    got, want = eng.read_kv("r2", 0, 64), eng.model_kv("r1")[:64]
    assert _close_enough(got, want) and not torch.equal(got, want)
    eng.run()
    eng.shutdown()


def test_vllm_connectors_never_load_another_codecs_chunks(pool):
    p1, _ = prompts()
    for writer, reader in (("int8", "none"), ("none", "int8")):
        eng = FakeVllmEngine(make_config("float16", kv_codec=writer, model_id=f"fake/{writer}-first"),
                             conn.KVPoolConnector, client=pool)
        eng.add_request("r1", p1)
        eng.run()
        eng.shutdown()
        cfg = make_config("float16", kv_codec=reader, model_id=f"fake/{writer}-first")
        sched = conn.KVPoolConnector(cfg, _scheduler_role(), client=pool)
        assert sched.get_num_new_matched_tokens(FakeRequest("r9", p1), 0) == (0, False)
        same = conn.KVPoolConnector(make_config("float16", kv_codec=writer, model_id=f"fake/{writer}-first"),
                                    _scheduler_role(), client=pool)
        assert same.get_num_new_matched_tokens(FakeRequest("r8", p1), 0)[0] == 96, "its own codec: a hit"


def _scheduler_role():
    from fakes.vllm_api import FakeKVConnectorRole

    return FakeKVConnectorRole.SCHEDULER


def test_vllm_unknown_codec_is_a_typed_error_at_startup():
    with pytest.raises(InvalidArgument, match="codec"):
        ConnectorSettings.from_vllm_config(make_config("float16", kv_codec="int3"))


# -- SGLang ----------------------------------------------------------------------------------------

PAGE, SIZE = 4, 64


def _backend(pool, host, **extra):
    cfg = FakeHiCacheStorageConfig(model_name="fake/model", extra_config={"weights_fingerprint": "w1", **extra})
    backend = backend_mod.KVPoolHiCacheStorage(cfg, {}, client=pool)
    backend.register_mem_pool_host(host)
    return backend


def _host(seed=0):
    host = FakeMHATokenToKVPoolHost(3, 2, 8, SIZE, PAGE, "page_first", torch.float16)
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=torch.Generator().manual_seed(seed)).half())
    return host


def test_sglang_backend_with_a_codec_encodes_on_save_and_decodes_on_load(pool):
    src = _host(1)
    keys = [f"{i:064x}" for i in range(1, 4)]
    writer = _backend(pool, src, kv_codec="int8")
    assert writer.layout.codec == "int8"
    assert writer.batch_set_v1(keys, torch.arange(0, 3 * PAGE)) == [True] * 3
    blob = pool.get(writer.pool_key(keys[0]))
    assert read_header(blob).codec_id == get_codec("int8").codec_id
    assert read_header(blob).payload_nbytes < KVLayout(3, 2, 8, "float16", PAGE).payload_nbytes(PAGE)  # (tiny pages: scales weigh)

    dst = FakeMHATokenToKVPoolHost(3, 2, 8, SIZE, PAGE, "page_first", torch.float16)
    reader = _backend(pool, dst, kv_codec="int8")
    assert reader.batch_get_v1(keys, torch.arange(16, 16 + 3 * PAGE)) == [True] * 3
    for t in range(3 * PAGE):
        assert _close_enough(dst.token_kv(16 + t), src.token_kv(t))


def test_sglang_backends_never_load_another_codecs_pages(pool):
    host = _host(2)
    keys = [f"{i:064x}" for i in range(10, 12)]
    int8 = _backend(pool, host, kv_codec="int8")
    plain = _backend(pool, host)
    assert int8.pool_key(keys[0]) != plain.pool_key(keys[0]), "the codec is part of the namespace"
    int8.batch_set_v1(keys, torch.arange(0, 2 * PAGE))
    assert plain.batch_exists(keys) == 0
    assert plain.batch_get_v1(keys, torch.arange(0, 2 * PAGE)) == [False, False]
    plain.batch_set_v1(keys, torch.arange(0, 2 * PAGE))
    assert int8.batch_exists(keys) == 2 and plain.batch_exists(keys) == 2  # each its own pages
    assert plain.stats["corrupt"] == 0 and int8.stats["corrupt"] == 0


def test_sglang_unknown_codec_is_a_typed_error():
    with pytest.raises(InvalidArgument, match="codec"):
        backend_mod.KVPoolHiCacheStorage(FakeHiCacheStorageConfig(extra_config={"kv_codec": "zip9"}), {})
