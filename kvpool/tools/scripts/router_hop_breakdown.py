"""Where the TTFT the router adds goes: a local cluster (router, one prefill and one decode
worker), 40 streaming chat requests through the router and 40 prefill calls straight to the
worker, twice, each batch read against the router's and the worker's own /metrics (the router's
arrival-to-first-token, the worker's prefill latency). Quoted in BENCHMARKS.md (router section).

    .venv/bin/python kvpool/tools/scripts/router_hop_breakdown.py
"""

from __future__ import annotations

import statistics

import httpx

from kvpool.tools.bench.router import TtftProbe


def _mean_of(url: str, metric: str) -> tuple[float, float]:
    total = count = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(metric + "_sum"):
            total = float(line.split()[-1])
        elif line.startswith(metric + "_count"):
            count = float(line.split()[-1])
    return total, count


def main() -> None:
    with TtftProbe() as probe:
        for _ in range(3):
            probe.via_router(), probe.direct()
        worker_url, router_url = probe.cluster.url("prefill"), probe.cluster.router_url
        for _ in range(2):
            for name, fn in (("via router", probe.via_router), ("direct", probe.direct)):
                w0, r0 = (_mean_of(worker_url, "kvpool_worker_prefill_seconds"),
                          _mean_of(router_url, "kvpool_router_ttft_seconds"))
                client = [fn() for _ in range(40)]
                w1, r1 = (_mean_of(worker_url, "kvpool_worker_prefill_seconds"),
                          _mean_of(router_url, "kvpool_router_ttft_seconds"))
                worker = 1e3 * (w1[0] - w0[0]) / max(1.0, w1[1] - w0[1])
                router = 1e3 * (r1[0] - r0[0]) / (r1[1] - r0[1]) if r1[1] > r0[1] else float("nan")
                print(f"{name:10s} client TTFT mean {statistics.fmean(client):7.2f} ms | worker prefill mean "
                      f"{worker:7.2f} ms | router arrival-to-first-token mean {router:7.2f} ms", flush=True)


if __name__ == "__main__":
    main()
