"""Bridges between inference engines and the pool.

    base           the adapter contract (EngineAdapter, KVEvent, LoadResult, SaveResult)
    chunk_reader   the one verified reader of chunk objects, with the one rule for a damaged chunk
    chunk_store    the engine-free half of every adapter: keys, writes, handles, events
    hf             the HuggingFace transformers adapter; model: the reference model
    vllm/          the vLLM v1 KV connector (scheduler side, worker side, metadata)
    sglang         the SGLang HiCache storage backend
    lmcache/       the LMCache remote storage plugin (KVPoolConnectorAdapter)
    serving/       the reference prefill / decode workers
    bench/         benchmarks that need an engine or start workers (`kvpool bench ...`)

Submodules are imported on use, so `import engine_adapters` stays cheap (no torch).
"""
