"""FAKE stand-ins for what cannot run here (vLLM's CUDA backends, SGLang, which needs CUDA) and a
dict-backed pool for simulated outages. Everything here is a fake and says so in its name and
docstring; the adapters in `engine_adapters` import and run without any of it.

    vllm_api     vLLM 0.32's connector role, config objects, attention backends and layers
    vllm_engine  a FAKE vLLM v1 engine driving a connector through vLLM's call sequence
    sglang_api   SGLang's HiCache storage config objects
    sglang_host  SGLang's MHA host KV pool (CPU tensors in its three layouts)
    dict_pool    a FAKE PoolClient over a dict (outage tests only)
"""
