"""Benchmarks that need a real engine or start reference workers, run by `kvpool bench <name>`
(the group lives in `kvpool.cli.bench`, the one place in kvpool that may import engine_adapters):

    adapter        TTFT of a long prompt, cold vs 50% / 90% cached in the pool (`--engine vllm` too)
    adapter_vllm   the vLLM cases of `bench adapter`: fresh real vLLM engines in .venv-vllm
    router         what the router costs: routing time, TTFT via the router vs direct
    cluster        `bench policies` and `bench disagg`: whole local clusters under a workload

The pool's own benchmarks (store, transfer, pool, serve) and their shared report shape are in
`kvpool.bench`.
"""
