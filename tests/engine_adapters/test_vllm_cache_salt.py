"""Tenants behind vLLM: a request's `cache_salt` (vLLM's per-request salt) salts the connector's
chunk key namespace, and the router hashes a tenant's prompt into exactly those keys.

Real parts: the connector driven through vLLM's call sequence by the FAKE engine
(tests/engine_adapters/fakes), the embedded pool on loopback, a keyring file, the router's
`Tenants` and the vLLM backend's namespace (what `--engine vllm` learns at registration).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from engine_adapters import vllm as conn
from fakes.vllm_engine import FakeVllmEngine
from kvpool.security.keyring import Keyring, engine_cache_salt, request_salt
from kvpool.client import connect
from kvpool.config import load_settings
from kvpool.embedded import EmbeddedPool
from kvpool.keys import chunk_keys_hex
from vllm_fake_support import CHUNK, DIM, HEADS, LAYERS, make_config, pool_chunk_keys, prompts


@pytest.fixture
def pool():
    server = EmbeddedPool(load_settings(port=0, admin_port=0, dram_capacity="64MiB")).start()
    client = connect(server.address)
    yield client
    client.close()
    server.stop()


@pytest.fixture(autouse=True)
def no_keyring(monkeypatch):
    """The connector's own salt comes from its config here, not from a keyring in the environment."""
    for name in ("KVPOOL_AUTH_FILE", "KVPOOL_PRINCIPAL", "KVPOOL_TENANT_SALT"):
        monkeypatch.delenv(name, raising=False)


def engine(pool, configured: str = "") -> FakeVllmEngine:
    extra = {"tenant_salt": configured} if configured else {}
    return FakeVllmEngine(make_config("float16", **extra), conn.KVPoolConnector, client=pool, paged_layout="kv_last")


def salted_keys(eng: FakeVllmEngine, tokens, cache_salt):
    return chunk_keys_hex(eng.worker.settings.namespace(0, cache_salt).digest(), tokens, CHUNK)


def test_two_salts_never_share_chunks_and_no_salt_keys_as_before(pool):
    eng = engine(pool)
    p1, _ = prompts()
    eng.add_request("a1", p1, cache_salt="tenant-a")
    assert eng.run()[0].matched == {"a1": 0}
    a_keys = salted_keys(eng, p1, "tenant-a")
    assert len(a_keys) == 3 and all(pool.exists(k) for k in a_keys), "saved in tenant-a's namespace"
    assert not any(pool.exists(k) for k in pool_chunk_keys(p1)), "nothing in the unsalted namespace"

    eng.add_request("b1", p1, cache_salt="tenant-b")
    assert eng.step().matched == {"b1": 0}, "the same prompt under another salt finds nothing"
    eng.run()
    b_keys = salted_keys(eng, p1, "tenant-b")
    assert all(pool.exists(k) for k in b_keys) and set(b_keys).isdisjoint(a_keys)

    eng.add_request("a2", p1, cache_salt="tenant-a")
    step = eng.step()
    assert step.matched == {"a2": 96} and not step.load_errors, "the same salt finds its 3 chunks"
    assert torch.equal(eng.read_kv("a2", 0, 96).view(torch.uint8), eng.model_kv("a1")[:96].view(torch.uint8))
    eng.run()

    eng.add_request("u1", p1)  # no cache_salt: the configured namespace, keys exactly as before salts
    assert eng.step().matched == {"u1": 0}
    eng.run()
    assert all(pool.exists(k) for k in pool_chunk_keys(p1))
    assert eng.worker.stats["loaded_chunks"] == 3
    eng.shutdown()


def test_salt_mixing():
    assert request_salt("", None) == "" and request_salt("dep", "") == "dep", "no cache_salt: as configured"
    salts = {request_salt(c, s) for c in ("", "dep", "a", '"') for s in ("x", "y", "dep", "a")}
    assert len(salts) == 16, "every (configured, cache_salt) pair its own namespace"
    assert not salts & {"", "dep", "a", '"', "x", "y"}, "never a plain configured salt"


def _keyring(tmp_path) -> Keyring:
    doc = {"principals": {
        "node": {"role": "node", "secret": "n" * 40},
        "acme": {"role": "tenant:acme", "secret": "a" * 40, "api_keys": ["sk-acme-0123456789abcdef"]},
        "beta": {"role": "tenant:beta", "secret": "b" * 40, "api_keys": ["sk-beta-0123456789abcdef"]}}}
    path = tmp_path / "keyring.json"
    path.write_text(json.dumps(doc))
    os.chmod(path, 0o600)
    return Keyring.load(path)


@pytest.mark.parametrize("configured", ["", "deployment-salt"])
def test_router_hashes_a_tenants_prompt_into_the_keys_the_connector_wrote(pool, tmp_path, configured):
    """`--engine vllm` with API keys: the router's tenant namespace (the backend's namespace doc,
    salted as tenants.py does behind vLLM) is the connector's for the tenant's cache_salt, so its
    lookups see exactly that tenant's chunks."""
    from kvpool.router.tenants import Tenants
    from kvpool.router.backends.vllm import VLLMSettings

    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS * 2, "num_key_value_heads": HEADS,
        "hidden_size": DIM * HEADS * 2, "head_dim": DIM, "dtype": "float16"}))
    extra = {"chunk_tokens": CHUNK, "model_id": "fake/model", "weights_fingerprint": "test-weights",
             **({"tenant_salt": configured} if configured else {})}
    ns, _ = VLLMSettings(str(tmp_path), extra).namespace("fake/model")
    ring = _keyring(tmp_path)
    tenants = Tenants(ring, None, via_cache_salt=True)
    tenants.learn(ns.canonical_json())
    acme, beta = (tenants.of(ring.tenant_entry(t)) for t in ("acme", "beta"))
    for t in (acme, beta):  # what vLLM accepts (vllm.entrypoints...validate_cache_salt): no '/', '@', '\', NUL; <= 128
        assert t.cache_salt == engine_cache_salt(t.salt) and len(t.cache_salt) <= 128
        assert not set(t.cache_salt) & set("@/\\\x00")

    eng = engine(pool, configured)
    p1, _ = prompts()
    eng.add_request("acme-1", p1, cache_salt=acme.cache_salt)
    eng.run()
    acme_keys = chunk_keys_hex(acme.namespace, p1, CHUNK)
    assert acme_keys == salted_keys(eng, p1, acme.cache_salt)
    assert pool.match_prefix(acme_keys) == 3, "the router's lookup for acme sees acme's chunks"
    assert pool.match_prefix(chunk_keys_hex(beta.namespace, p1, CHUNK)) == 0, "beta's sees none"
    assert pool.match_prefix(chunk_keys_hex(ns.digest(), p1, CHUNK)) == 0, "nor the untenanted namespace"
    eng.shutdown()
