"""Where the TTFT the router adds goes: a local cluster (router, one prefill and one decode
worker), 40 streaming chat requests through the router and 40 prefill calls straight to the
worker, twice, each batch read against the router's and the worker's own /metrics (the router's
arrival-to-first-token, the worker's prefill latency). Quoted in BENCHMARKS.md (router section).

    .venv/bin/python benchmarks/router_hop_breakdown.py
"""

from __future__ import annotations

import statistics
import tempfile
import time

import httpx

from engine_adapters.serving.client import WorkerClient
from engine_adapters.serving.launcher import LocalCluster, RouterSpec, WorkerSpec


def _mean_of(url: str, metric: str) -> tuple[float, float]:
    total = count = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(metric + "_sum"):
            total = float(line.split()[-1])
        elif line.startswith(metric + "_count"):
            count = float(line.split()[-1])
    return total, count


def main() -> None:
    cluster = LocalCluster(tempfile.mkdtemp(prefix="kvpool-hop-"), [WorkerSpec("prefill", "prefill"),
                                                                    WorkerSpec("decode", "decode")],
                           router=RouterSpec(args=["--local-prefill-tokens", "0"]))
    with cluster:
        messages = [{"role": "user", "content": "In one word, what colour is the sea?"}]
        body = {"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "messages": messages, "max_tokens": 2,
                "temperature": 0, "stream": True}
        prefill, decode = WorkerClient(cluster.url("prefill")), WorkerClient(cluster.url("decode"))
        ids = prefill.tokenize(messages=messages)
        http = httpx.Client(timeout=60)

        def via() -> float:
            started, first = time.perf_counter(), None
            with http.stream("POST", f"{cluster.router_url}/v1/chat/completions", json=body) as resp:
                for line in resp.iter_lines():
                    if first is None and line.startswith("data: {") and '"content":"' in line \
                            and '"content":""' not in line:
                        first = time.perf_counter() - started
            return first * 1e3

        def direct() -> float:
            started = time.perf_counter()
            head = prefill.prefill(ids)
            ttft = time.perf_counter() - started
            for _ in decode.decode(head.handle, head.first_token, 2):
                pass
            return ttft * 1e3

        for _ in range(3):
            via(), direct()
        for _ in range(2):
            for name, fn in (("via router", via), ("direct", direct)):
                w0, r0 = (_mean_of(cluster.url("prefill"), "kvpool_worker_prefill_seconds"),
                          _mean_of(cluster.router_url, "kvpool_router_ttft_seconds"))
                client = [fn() for _ in range(40)]
                w1, r1 = (_mean_of(cluster.url("prefill"), "kvpool_worker_prefill_seconds"),
                          _mean_of(cluster.router_url, "kvpool_router_ttft_seconds"))
                worker = 1e3 * (w1[0] - w0[0]) / max(1.0, w1[1] - w0[1])
                router = 1e3 * (r1[0] - r0[0]) / (r1[1] - r0[1]) if r1[1] > r0[1] else float("nan")
                print(f"{name:10s} client TTFT mean {statistics.fmean(client):7.2f} ms | worker prefill mean "
                      f"{worker:7.2f} ms | router arrival-to-first-token mean {router:7.2f} ms", flush=True)
        http.close()
        prefill.close()
        decode.close()


if __name__ == "__main__":
    main()
