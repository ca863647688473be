"""`kvpool bench kvevents`: repeated prefixes behind the router, routed with the vLLM instances'
KV events (each instance's own prefix cache, plus the pool) against the pool's view alone.

Two colocated vLLM servers (`kv_both`, the kvpool connector, `--kv-events-config`) and two
routers over them, in one run: `events` follows the servers' KV events, `pool_only` does not
(only `match_prefix` tells it what is cached). For each of `--prefixes` documents (distinct
seeded text): the document with one question goes straight to one server, its "home" (homes
alternate), as an earlier conversation that landed there: that server's prefix cache holds the
document, and the pool its whole chunks. Then the same document with another question goes
through one router (`events` and `pool_only` take turns, each sees both homes equally often), and
its time to first token (streamed, at the client) is measured, with the cached tokens the server
reports and whether it landed on the home server.

The pool's view cannot tell the servers apart (both would load the same chunks), so where it
lands is up to load and tie-breaks (idle here: the first server); with the events the router
sends it home, where the prefix cache serves the prompt block by block (vLLM's 32-token blocks,
not only whole 256-token chunks) with nothing to fetch.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import click
import httpx

from kvpool.tools.bench.report import Report, progress

QUESTIONS = ("Q: What is the text above about?\nA:", "Q: Which word does the text above use most?\nA:")


def document(seed: int, words: int) -> str:
    from kvpool.tools.bench.workloads import VOCAB

    rng = random.Random(f"kvevents-{seed}")
    lines = [" ".join(rng.choice(VOCAB) for _ in range(12)) for _ in range(max(1, words // 12))]
    return ".\n".join(lines) + ".\n\n"


def _served(router_url: str) -> dict[str, int]:
    return {w["url"]: w["served"] for w in httpx.get(router_url + "/admin/workers", timeout=10).json()["workers"]}


def _stream(url: str, model: str, prompt: str, max_tokens: int) -> tuple[float, int, int]:
    """(TTFT s, prompt tokens, cached tokens) of one streamed completion at `url` (…/v1)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started, ttft, usage = time.perf_counter(), None, {}
    with httpx.stream("POST", url + "/completions", json=body, timeout=600) as resp:
        if resp.status_code != 200:
            raise click.ClickException(f"{url} answered {resp.status_code}: {resp.read()[:300]!r}")
        for line in resp.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if ttft is None and any(c.get("text") for c in chunk.get("choices") or ()):
                ttft = time.perf_counter() - started
            usage = chunk.get("usage") or usage
    cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    return ttft or time.perf_counter() - started, int(usage.get("prompt_tokens") or 0), int(cached)


@click.command()
@click.option("--prefixes", type=click.IntRange(min=2), default=10, show_default=True,
              help="Documents, each sent once to its home server and once through a router (half per router).")
@click.option("--prefix-words", type=int, default=700, show_default=True, help="Words per document (~ tokens).")
@click.option("--max-tokens", type=int, default=2, show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
@click.option("--settle-s", type=float, default=1.0, show_default=True,
              help="Wait after the home request, before the measured one (for both routers alike).")
@click.option("--vllm-python", help="The Python that runs the servers (default: .venv-vllm's, else this one).")
@click.option("--workdir", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True)
def kvevents(prefixes, prefix_words, max_tokens, dtype, settle_s, vllm_python, workdir, as_json) -> None:
    """TTFT of repeated prefixes routed with the vLLM servers' KV events vs the pool's view alone."""
    from kvpool.tools.bench.adapter_vllm import vllm_python as find_python
    from kvpool.tools.launch.vllm import VLLMCluster, check_python, reference_spec

    python = find_python(vllm_python)
    check_python(python)
    workdir = Path(workdir or tempfile.mkdtemp(prefix="kvpool-bench-kvevents-"))
    spec = reference_spec(python=python, dtype=dtype, max_model_len=max(1024, 2 * prefix_words + 256))
    cluster = VLLMCluster(workdir, spec, ["both", "both"], kv_events=True)
    report = Report("kvevents")
    rows: dict[str, list[dict[str, Any]]] = {"events": [], "pool_only": []}
    homes: list[dict[str, Any]] = []
    say = (lambda msg: click.echo(msg, err=True))
    cluster.start(say)
    pool_only = None
    try:
        pool_only = cluster.extra_router(workdir / "pool-only", [], kv_events=False)
        urls = {"events": cluster.router_url, "pool_only": pool_only.router_url}
        servers = sorted(cluster.servers.values(), key=lambda p: p.name)
        deadline = time.monotonic() + 60
        while len([u for u in _served(urls["pool_only"])]) < len(servers) and time.monotonic() < deadline:
            time.sleep(0.2)
        model = spec.model_id
        for name, url in urls.items():  # warm-up: a cold prompt through each router (not measured)
            _stream(url + "/v1", model, document(10_000 + len(name), 100) + QUESTIONS[0], max_tokens)
        bar, step = progress(prefixes, "kvevents")
        with bar:
            for i in range(prefixes):
                name = "events" if i % 2 == 0 else "pool_only"
                home = servers[(i // 2) % 2]
                doc = document(i, prefix_words)
                warm_s, _, _ = _stream(home.url + "/v1", model, doc + QUESTIONS[0], 1)
                homes.append({"server": home.name, "ttft_ms": round(warm_s * 1e3, 1)})
                time.sleep(settle_s)
                before = _served(urls[name])
                ttft, prompt_tokens, cached = _stream(urls[name] + "/v1", model, doc + QUESTIONS[1], max_tokens)
                after = _served(urls[name])
                landed = next((u for u in after if after[u] > before.get(u, 0)), None)
                rows[name].append({"ttft_ms": ttft * 1e3, "prompt_tokens": prompt_tokens, "cached": cached,
                                   "home": landed == home.url})
                step()
    finally:
        if pool_only is not None:
            pool_only.stop()
        cluster.stop()

    def summary(name: str) -> dict[str, Any]:
        r = rows[name]
        return {"landed_home": f"{sum(x['home'] for x in r)}/{len(r)}",
                "cached_tokens_mean": round(statistics.mean(x["cached"] for x in r), 1),
                "computed_tokens_mean": round(statistics.mean(x["prompt_tokens"] - x["cached"] for x in r), 1),
                "prompt_tokens_mean": round(statistics.mean(x["prompt_tokens"] for x in r), 1),
                "ttft_ms": [round(x["ttft_ms"], 1) for x in r],
                "ttft_home_ms": [round(x["ttft_ms"], 1) for x in r if x["home"]],
                "ttft_elsewhere_ms": [round(x["ttft_ms"], 1) for x in r if not x["home"]]}

    ev, base = [x["ttft_ms"] for x in rows["events"]], [x["ttft_ms"] for x in rows["pool_only"]]
    report.add("ttft/events", ev, "ms", baseline="pool_only", baseline_values=base, extra=summary("events"))
    report.add("ttft/pool_only", base, "ms", extra=summary("pool_only"))
    report.add("ttft_mean/events", [statistics.mean(ev)], "ms", baseline="pool_only",
               baseline_values=[statistics.mean(base)])
    for name in rows:  # where it landed: no ratio (the pool's view may land home by chance, or never)
        report.add(f"landed_home/{name}", [sum(x["home"] for x in rows[name]) / len(rows[name])], "fraction")
    report.setup = {"servers": 2, "roles": "kv_both", "dtype": dtype, "prefixes": prefixes,
                    "prefix_words": prefix_words, "max_tokens": max_tokens, "chunk_tokens": spec.chunk_tokens,
                    "block_size": spec.block_size, "home_requests": homes}
    report.notes.append(f"{prefixes} documents of ~{prefix_words} words, each first sent to its home server (homes "
                        "alternate), then with another question through the `events` or the `pool_only` router "
                        "(alternating); TTFT streamed at the client; 2 colocated vLLM servers (kv_both), "
                        f"{dtype}, sharing this machine's cores")
    report.emit(as_json)
