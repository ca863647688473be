"""The cache-aware router: an OpenAI-compatible front that places each request on a prefill and a
decode worker (or one colocated worker) by estimated cost, reaching workers over HTTP only.

    policy      the pure decision: RoundRobin, LeastLoaded, CacheAware (also run by the simulator)
    cost        the cost model the estimates use, fitted online from the workers' timings
    tokenizer   the model's tokenizer and chat template, fetched from a worker, with a sentence cache
    workers     membership, load polling, KV events (what each worker caches), drain
    service     Router: route, execute (prefill -> decode, or generate), retry
    openai_api  the OpenAI request/response/error shapes
    app         FastAPI endpoints;  server: the process (`kvpool router`)
"""
