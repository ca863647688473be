"""The reference prefill / decode workers (`kvpool worker --role prefill|decode|both`).

    service.Worker      the model, its local prefix cache, the pool and the scheduler
    scheduler.Scheduler continuous batching with decode priority (one engine thread)
    prefix_cache        the worker's own bounded LRU prefix cache ("HBM" tier) + KV events
    kvio                DynamicCache <-> chunk tensors (pool reads: engine_adapters.chunk_reader)
    app / server        the HTTP control API (FastAPI + uvicorn) and the worker process
    client              WorkerClient and `generate(prefill, decode, ids)`: the disaggregated path
    sampling            greedy or seeded temperature/top-p sampling (same seed, same tokens on any worker)
    admission           draining and in-flight counts (a draining worker finishes, then leaves)
    launcher            LocalCluster: pool, router and workers as real processes on free loopback ports

The wire messages are `kvpool.worker_api` (the router, in kvpool, speaks them too).

Submodules are imported on use, so importing this package does not load torch.
"""
