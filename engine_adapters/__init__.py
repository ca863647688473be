"""Bridges between inference engines and the pool.

    base           the adapter contract (EngineAdapter, KVEvent, LoadResult, SaveResult)
    chunk_reader   the one verified reader of chunk objects, with the one rule for a damaged chunk
    chunk_store    the engine-free half of every adapter: keys, writes, handles, events
    hf             the HuggingFace transformers adapter
    vllm/          the vLLM v1 KV connector (scheduler side, worker side, metadata)
    sglang         the SGLang HiCache storage backend
    lmcache/       the LMCache remote storage plugin (KVPoolConnectorAdapter)
    compat         the engine releases each integration is tested with

Submodules are imported on use, so `import engine_adapters` stays cheap (no torch).
"""
