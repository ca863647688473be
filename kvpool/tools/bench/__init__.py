"""Every `kvpool bench <name>` (listed in `command.py`): each measures our figure and its
baseline in the same run; `report.py` is the shared shape (alternating repetitions, median,
spread, JSON last line).

    store, transfer, pool     the pool's data path against memcpy, raw sockets, Redis, Mooncake Store
    serve                     a served cluster under a workload (TTFT, TPOT, reuse)
    adapter                   TTFT of a long prompt, cold vs cached in the pool (`--engine vllm` too)
    router                    what the router costs: routing time, TTFT via the router vs direct
    policies, disagg          whole local clusters: routing policies; colocated vs disaggregated
    engine                    the reference engine's batched decode against batch-1 sequences
    overhead                  a worker with the pool vs without, on a workload with no reuse
    codec                     KV codecs: size, speed and greedy-token agreement
    gpu_check                 `make gpu-check`: host<->device copies of the arena, the `cuda` suites
"""
