"""`kvpool bench lmcache`: LMCache with the kvpool as its remote store, against LMCache's own local
CPU backend and LMCache with a Redis remote, in one run (needs the `lmcache` package: run it in
.venv-lmcache, `make lmcache-env`).

The chunks are LMCache's for SmolLM2-135M-Instruct (the reference model): 256 tokens x 30 layers x
K and V x 3 KV heads x 64 in bfloat16, 5.625 MiB each; the KV is random (bytes are bytes).
- `chunk_put` / `chunk_get` (GB/s): a batch of `--chunks` chunks through LMCache's storage
  backend objects, as its StorageManager drives them: `batched_submit_put_task` until every chunk's
  completion callback has fired, and `batched_get_blocking`. kvpool and Redis are each a
  `RemoteBackend` (LMCache's remote storage plugin, through its connector wrapper); the local CPU
  backend keeps the very `MemoryObj` it is handed (a dict insert and lookup, no copy): a ceiling.
- `prefix_store` / `prefix_load` (ms): LMCache's engine storing a `--prefix-tokens` prompt's KV
  (until it is in the backend) and loading it back into the engine's KV buffer (`retrieve`: lookup,
  get, copy into place), the part of a cached prefix's time to first token that the cache owns.
  The remote engines have no local CPU tier (`local_cpu: false`), so every load comes from the
  remote; the local one loads from its own CPU tier.
LMCache has no CPU "GPU connector"; the engine moves KV with `lmcache_cpu.CPUKVConnector` (one
tensor copy per chunk each way), the same for all three. vLLM with LMCache does not run on CPU
(LMCache 0.5.6: "No supported cpu connector found"), so no vLLM time to first token is measured here.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from typing import Any, Callable

import click

from kvpool.tools.bench.report import Report, gbps, progress

CHUNK_TOKENS = 256
_hashes = itertools.count(1 << 40)


class _Loop:
    """An asyncio loop on a thread, as LMCache's StorageManager runs one for its backends."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="bench-lmcache-loop")
        self.thread.start()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _abandon_redis_engine(eng: Any) -> None:
    """LMCache 0.5.6's Redis connector deadlocks in close(): on its event loop it waits for its job
    executor's shutdown, which needs that same loop. So a Redis engine is not closed: its storage
    manager's loop (a non-daemon thread) is stopped, and redis-server goes away below."""
    import logging

    manager = eng.storage_manager
    manager.loop.call_soon_threadsafe(manager.loop.stop)
    manager.thread.join(10)
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # its executor's tasks die pending, by design here


class BackendSide:
    """One of LMCache's storage backends, timed the way its StorageManager uses it."""

    def __init__(self, name: str, backend: Any, remote: bool):
        self.name, self.backend, self.remote = name, backend, remote

    def put(self, keys: list, objs: list, timeout: float = 120) -> float:
        done, lock, count = threading.Event(), threading.Lock(), [0]

        def on_complete(_key: Any) -> None:
            with lock:
                count[0] += 1
                if count[0] == len(keys):
                    done.set()

        start = time.perf_counter()
        self.backend.batched_submit_put_task(keys, objs, on_complete_callback=on_complete)
        if not done.wait(timeout):
            raise RuntimeError(f"{self.name}: {count[0]} of {len(keys)} puts completed in {timeout}s")
        return time.perf_counter() - start

    def get(self, keys: list) -> tuple[float, list]:
        start = time.perf_counter()
        objs = self.backend.batched_get_blocking(keys)
        seconds = time.perf_counter() - start
        if any(o is None for o in objs):
            raise RuntimeError(f"{self.name}: {sum(o is None for o in objs)} of {len(keys)} chunks missing on get")
        return seconds, objs


def _bench_chunks(report: Report, sides: list[BackendSide], alloc: Any, md: Any, n: int, reps: int,
                  clear: Callable[[BackendSide, list], None], tick: Callable[[], None]) -> None:
    import torch

    from lmcache.utils import CacheEngineKey

    shape = torch.Size([2, md.kv_shape[0], CHUNK_TOKENS, md.kv_shape[3] * md.kv_shape[4]])
    sources = []
    for i in range(n):
        obj = alloc.allocate([shape], [md.kv_dtype])
        obj.tensor.copy_(torch.randn(shape, generator=torch.Generator().manual_seed(i)).to(md.kv_dtype))
        sources.append(obj)
    nbytes = n * sources[0].get_size()
    puts: dict[str, list[float]] = {s.name: [] for s in sides}
    gets: dict[str, list[float]] = {s.name: [] for s in sides}
    for rep in range(reps + 1):  # the first round warms up (connections, allocator pages)
        for side in sides:  # ours first, then the baselines, every round
            keys = [CacheEngineKey(md.model_name, 1, 0, next(_hashes), md.kv_dtype) for _ in range(n)]
            put_s = side.put(keys, sources)
            get_s, got = side.get(keys)
            if rep == 0 and not all(torch.equal(g.tensor, s.tensor) for g, s in zip(got[:1] + got[-1:], sources[:1] + sources[-1:])):
                raise RuntimeError(f"{side.name}: a chunk read back differs from what was stored")
            for obj in got:
                obj.ref_count_down()
            clear(side, keys)
            if rep:
                puts[side.name].append(gbps(nbytes, put_s))
                gets[side.name].append(gbps(nbytes, get_s))
        tick()
    for obj in sources:
        obj.ref_count_down()
    ours = sides[0].name
    for base in sides[1:]:
        extra = {"chunks": n, "chunk_bytes": sources[0].get_size(), "peer": base.name}
        report.add("chunk_put", puts[ours], "GB/s", size=nbytes, baseline=base.name,
                   baseline_values=puts[base.name], extra=extra)
        report.add("chunk_get", gets[ours], "GB/s", size=nbytes, baseline=base.name,
                   baseline_values=gets[base.name], extra=extra)


def _bench_prefix(report: Report, engines: dict[str, Any], md: Any, prefix_tokens: int, reps: int,
                  tick: Callable[[], None]) -> None:
    import torch

    names = list(engines)
    stores: dict[str, list[float]] = {n: [] for n in names}
    loads: dict[str, list[float]] = {n: [] for n in names}
    kv = torch.randn(2, md.kv_shape[0], prefix_tokens, md.kv_shape[3] * md.kv_shape[4]).to(md.kv_dtype)
    for rep in range(reps + 1):
        for name in names:
            eng = engines[name]
            base = 1000 + (rep * len(names) + names.index(name)) * prefix_tokens  # a new prompt each time
            tokens = torch.arange(base, base + prefix_tokens)
            keys = [k for s, e, k in eng.token_database.process_tokens(tokens)]
            start = time.perf_counter()
            eng.store(tokens, kvcaches=kv)
            deadline = time.monotonic() + 120
            while eng.storage_manager.batched_contains(keys)[0] < len(keys):  # remote puts are asynchronous
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name}: the prefix did not reach the backend in 120 s")
                time.sleep(0.0005)
            store_s = time.perf_counter() - start
            out = torch.zeros_like(kv)
            start = time.perf_counter()
            mask = eng.retrieve(tokens, kvcaches=out)
            load_s = time.perf_counter() - start
            if int(mask.sum()) != prefix_tokens or (rep == 0 and not torch.equal(out, kv)):
                raise RuntimeError(f"{name}: retrieve loaded {int(mask.sum())} of {prefix_tokens} tokens")
            if rep:
                stores[name].append(store_s * 1000)
                loads[name].append(load_s * 1000)
        tick()
    ours = names[0]
    for base in names[1:]:
        extra = {"prefix_tokens": prefix_tokens, "peer": base}
        report.add("prefix_store", stores[ours], "ms", size=prefix_tokens, baseline=base,
                   baseline_values=stores[base], extra=extra)
        report.add("prefix_load", loads[ours], "ms", size=prefix_tokens, baseline=base,
                   baseline_values=loads[base], extra=extra)


@click.command("lmcache")
@click.option("--json", "as_json", is_flag=True, help="End with one JSON line (see BENCH.md).")
@click.option("--reps", default=5, show_default=True, help="Rounds per figure (after one warm-up round).")
@click.option("--chunks", default=16, show_default=True, help="Chunks per put/get batch (16: a 4,096-token prompt).")
@click.option("--prefix-tokens", default=2048, show_default=True, help="Tokens of the cached prefix (whole chunks).")
@click.option("--no-redis", is_flag=True, help="Leave out the Redis baseline.")
def lmcache(as_json: bool, reps: int, chunks: int, prefix_tokens: int, no_redis: bool) -> None:
    """LMCache + kvpool vs LMCache's local CPU backend and LMCache + Redis (needs lmcache)."""
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")
    try:
        from kvpool.tools.bench import lmcache_cpu as lc
    except ImportError as exc:
        raise click.ClickException(f"kvpool bench lmcache needs the lmcache package ({exc}); run it in .venv-lmcache "
                                   "(make lmcache-env): .venv-lmcache/bin/kvpool bench lmcache") from None
    import lmcache
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    from lmcache.v1.storage_backend.remote_backend import RemoteBackend

    from kvpool.tools.bench.pool_peers import RedisPeer
    from kvpool.tools.bench.pool_process import PoolProcess

    if prefix_tokens % CHUNK_TOKENS:
        raise click.BadParameter(f"--prefix-tokens must be a multiple of {CHUNK_TOKENS}")
    report = Report("lmcache")
    md = lc.metadata()
    chunk_bytes = 2 * md.kv_shape[0] * CHUNK_TOKENS * md.kv_shape[3] * md.kv_shape[4] * md.kv_dtype.itemsize
    report.setup = {"lmcache": getattr(lmcache, "__version__", "?"), "model": md.model_name, "dtype": str(md.kv_dtype),
                    "chunk_tokens": CHUNK_TOKENS, "chunk_bytes": chunk_bytes, "chunks": chunks,
                    "prefix_tokens": prefix_tokens, "reps": reps}
    pool = PoolProcess(1 << 30)
    redis = None
    if not no_redis:
        try:
            redis = RedisPeer(maxmemory="2gb")
        except RuntimeError as exc:
            report.notes.append(f"Redis baseline left out: {exc}")
    cleanup: list[Callable[[], None]] = []
    try:
        pool.settle()
        kv_url = f"kvpool://{pool.address}"
        redis_url = f"redis://127.0.0.1:{redis.port}" if redis else None
        loop = _Loop()
        cleanup.append(loop.close)
        # one allocator for the sources and every remote get, as LMCache's local CPU backend is for its remotes
        alloc_cfg = lc.config("bench-alloc", cpu_gb=max(0.5, 3 * chunks * chunk_bytes / 1e9), kvpool_url=kv_url,
                              redis_url=redis_url, local_cpu=False)
        alloc = LocalCPUBackend(alloc_cfg, md, "cpu")
        cleanup.append(alloc.close)
        sides = [BackendSide("kvpool", RemoteBackend(alloc_cfg, md, loop.loop, alloc, "cpu", plugin_name="kvpool"), True)]
        local = LocalCPUBackend(lc.config("bench-local", cpu_gb=max(0.5, 2 * chunks * chunk_bytes / 1e9)), md, "cpu")
        cleanup.append(local.close)
        sides.append(BackendSide("lmcache_local_cpu", local, False))
        if redis is not None:
            sides.append(BackendSide("lmcache_redis", RemoteBackend(alloc_cfg, md, loop.loop, alloc, "cpu",
                                                                    plugin_name="redis"), True))
        cleanup.append(sides[0].backend.close)  # the Redis backend is not closed: see _abandon_redis_engine

        def clear(side: BackendSide, keys: list) -> None:
            if side.name == "kvpool":
                for k in keys:
                    side.backend.remove(k)
            elif side.name == "lmcache_redis":
                redis.client.flushall()
            else:
                for k in keys:
                    side.backend.remove(k)

        engines = {"kvpool": lc.engine("bench-kvpool", lc.config("bench-kvpool", kvpool_url=kv_url, local_cpu=False,
                                                                 cpu_gb=1.0), md),
                   "lmcache_local_cpu": lc.engine("bench-local-engine", lc.config("bench-local-engine", cpu_gb=2.0), md)}
        cleanup.extend(lambda name=name: lc.close(name) for name in ("bench-kvpool", "bench-local-engine"))
        if redis_url is not None:
            engines["lmcache_redis"] = lc.engine("bench-redis", lc.config("bench-redis", redis_url=redis_url,
                                                                          local_cpu=False, cpu_gb=1.0), md)
            cleanup.append(lambda: _abandon_redis_engine(engines["lmcache_redis"]))

        bar, tick = progress(2 * (reps + 1), "lmcache")
        with bar:
            _bench_chunks(report, sides, alloc, md, chunks, reps, clear, tick)
            _bench_prefix(report, engines, md, prefix_tokens, reps, tick)
        kvpool_side = sides[0].backend.connection.getWrappedConnector()
        report.setup["kvpool_connector_stats"] = dict(kvpool_side.stats)
        report.notes.append("lmcache_local_cpu keeps the MemoryObj it is handed (no copy): chunk_put/chunk_get "
                            "against it compare with a dict insert and lookup, a ceiling")
        report.notes.append("vLLM + LMCache 0.5.6 on CPU stops at LMCache's CreateGPUConnector (\"No supported cpu "
                            "connector found\"): prefix_load is LMCache's own load of a cached prefix, not a vLLM TTFT")
    finally:
        for fn in reversed(cleanup):
            try:
                fn()
            except Exception:  # best effort: every server below is stopped regardless
                pass
        if redis is not None:
            redis.close()
        pool.close()
    report.emit(as_json)
