"""Tooling that ships with kvpool but is not the product: nothing in the pool, the router or the
adapters imports it (an import-linter contract).

    launch    `kvpool up`: pool, router and workers (reference or vLLM) as processes on one machine
    bench     `kvpool bench <name>`: every benchmark, each with its baseline measured in the same run
    sim       `kvpool sim`: the discrete-event cluster simulator, planner and calibration
    chaos     `kvpool chaos` / `kvpool soak`: fault campaigns on real clusters and their checker
    scripts   one-off profiling scripts (run with `python -m kvpool.tools.scripts.<name>`)
    vllm_run  a real vLLM engine in .venv-vllm, driven by the adapter bench and the vLLM suite
"""
