"""The router's vLLM backend without vLLM: what it reads from a model folder and from vLLM's
Prometheus text. (It runs against real vLLM servers in tests/engine_adapters/vllm_real.)"""

from __future__ import annotations

import json

import pytest

from kvpool.errors import InvalidArgument
from kvpool.keys import Namespace
from kvpool.chunk_format import KVLayout
from kvpool.router.backends import ReferenceBackend, VLLMBackend, make_backend
from kvpool.router.backends.vllm import VLLMSettings, parse_metrics

# The shape of vLLM 0.32's /metrics (abridged from a CPU server).
METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:cache_config_info{block_size="32",cache_dtype="auto",engine="0",num_cpu_blocks="None",num_gpu_blocks="728"} 1.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 1.5
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 30.0
"""


def test_parse_metrics():
    m = parse_metrics(METRICS)
    assert m["vllm:num_requests_running"] == 3 and m["vllm:num_requests_waiting"] == 2
    assert m["vllm:kv_cache_usage_perc"] == 0.25
    assert (m["block_size"], m["cache_blocks"]) == (32, 728)
    assert m["vllm:inter_token_latency_seconds_sum"] / m["vllm:inter_token_latency_seconds_count"] == 0.05


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
        "head_dim": 64, "dtype": "float32", "eos_token_id": 2}))
    return tmp_path


def test_namespace_is_the_connectors(folder):
    """Same inputs as the connector's ConnectorSettings: model id (vLLM's --model unless set),
    fingerprint, layout with vLLM's dtype (auto: float32 downcast to bfloat16), chunk size, salt."""
    settings = VLLMSettings(str(folder), {"chunk_tokens": 64, "weights_fingerprint": "w", "tenant_salt": "t"})
    ns, chunk = settings.namespace("/models/x")
    assert chunk == 64
    assert ns == Namespace("/models/x", "w", KVLayout(30, 3, 64, "bfloat16", 64), tenant_salt="t")
    pinned = VLLMSettings(str(folder), {"model_id": "org/m"}, kv_dtype="float32").namespace("/models/x")[0]
    assert pinned == Namespace("org/m", "unversioned", KVLayout(30, 3, 64, "float32", 256))


def test_tokenizer_info_needs_the_tokenizer(folder):
    with pytest.raises(InvalidArgument, match="tokenizer.json"):
        VLLMSettings(str(folder)).tokenizer_info("m")


def test_make_backend(folder):
    assert isinstance(make_backend("reference", None), ReferenceBackend)
    assert isinstance(make_backend("vllm", VLLMSettings(str(folder))), VLLMBackend)
    with pytest.raises(InvalidArgument, match="--tokenizer"):
        make_backend("vllm", None)
    with pytest.raises(InvalidArgument, match="unknown engine"):
        make_backend("sglang", None)


def test_namespace_agrees_with_the_connector_settings(folder):
    """The connector's own ConnectorSettings, fed the config vLLM would give it, names the same
    namespace: the router's pool lookups see what the servers write."""
    from types import SimpleNamespace

    from engine_adapters.vllm.settings import ConnectorSettings

    extra = {"chunk_tokens": 128, "weights_fingerprint": "w", "kvpool_address": "127.0.0.1:1"}
    model = SimpleNamespace(model="/models/x", dtype="bfloat16", revision=None, get_num_layers=lambda p: 30,
                            get_num_kv_heads=lambda p: 3, get_head_size=lambda: 64)
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra, kv_role="kv_consumer"),
        model_config=model, cache_config=SimpleNamespace(block_size=32, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1))
    connector = ConnectorSettings.from_vllm_config(vllm_config).namespace(0)
    assert VLLMSettings(str(folder), extra).namespace("/models/x")[0] == connector
