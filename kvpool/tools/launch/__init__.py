"""Starting kvpool as processes on one machine (a tool, not the product): `kvpool up`, the
benches and the tests use it.

    processes  spawn a `kvpool` subcommand, a free loopback port, stop and reap
    local      LocalCluster: pool, router and reference workers on free loopback ports
    vllm       VLLMCluster: the same with real vLLM servers (.venv-vllm) behind the router
    up         `kvpool up`: one of those clusters, serving until Ctrl-C, or the demo
"""
