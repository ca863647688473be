"""`kvpool sim`: a discrete-event model of a serving cluster (prefill, decode or colocated
instances, the pool's tiers and links) driven by Mooncake-format traces, running the real router
policies (`kvpool.router.policy`) and eviction policies (`kvpool.tiers.policy`) unchanged.

    command.py    the `kvpool sim` commands (run, plan, calibrate, study, validate)
    workload.py   requests: Mooncake traces, synthetic sessions, tokenized bench workloads
    profile.py    timing of prefill, decode steps and KV movement (JSON; `local` is calibrated)
    roofline.py   GPU profiles from FLOPs and HBM bandwidth
    calibrate.py  measures this machine's reference workers into the `local` profile
    pool.py       the pool's DRAM / SSD tiers with a real eviction policy
    instance.py   one instance's scheduler (decode-priority continuous batching)
    engine.py     the event loop, the request's life, the router's decision
    results.py    hit ratios, TTFT / TBT, SLO attainment, busy, cost
    goodput.py    DistServe's goodput by a rate search
    plan.py       the capacity planner's sweep
    plot.py       PNGs

Nothing is imported here, so `kvpool sim --help` loads none of it.
"""
