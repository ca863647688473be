"""The reference prefill / decode workers (`kvpool worker --role prefill|decode|both`).

    service.Worker      the model, its local prefix cache, the pool and the engine
    engine.Engine       the engine thread: schedule a step, run it as one forward, hand out results
    scheduler.Scheduler continuous batching: decode first, prefill chunks under a token budget
    model_runner        one forward over a batch of sequences (the model's own modules, packed rows)
    kv_cache            a sequence's KV in the pool's chunk layout, grown in place
    sequence            a prefill job and a decode sequence
    prefix_cache        the worker's own bounded LRU prefix cache ("HBM" tier) + KV events
    cpus                pinning workers to cores of their own
    app / server        the HTTP control API (FastAPI + uvicorn) and the worker process
    client              WorkerClient and `generate(prefill, decode, ids)`: the disaggregated path
    detokenizer         incremental text of a stream (holds back a partial UTF-8 character)
    sampling            greedy or seeded temperature/top-p sampling (same seed, same tokens on any worker)
    admission           draining and in-flight counts (a draining worker finishes, then leaves)

The wire messages are `kvpool.worker_api` (the router, in kvpool, speaks them too).

Submodules are imported on use, so importing this package does not load torch.
"""
