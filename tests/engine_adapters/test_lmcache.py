"""The LMCache remote storage plugin (engine_adapters.lmcache) against real `kvpool serve` processes.

Two halves:
- Engine-free (every environment): the plugin URL, and LMCache-format KV through kvpool chunk
  objects and the adapters' chunk reader, on the embedded pool.
- With the real `lmcache` package (`make test` runs this file in .venv-lmcache; elsewhere those
  tests skip): LMCache's own objects (`CacheEngineKey`, `MemoryObj`s from its `LocalCPUBackend`),
  the connector built the way LMCache builds it (its `ConnectorManager` reading the plugin entry),
  its `StorageManager`, and its `LMCacheEngine` storing a prompt in one process and loading the
  prefix in another. LMCache has no CPU "GPU connector" (it raises "No supported cpu connector
  found"), so the engine test moves KV with `kvpool.tools.bench.lmcache_cpu.CPUKVConnector`, a
  CPU implementation of LMCache's connector interface; everything else is LMCache's own code.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

from engine_adapters.chunk_reader import ANY_TOKENS, ChunkReader
from engine_adapters.lmcache.chunks import LMCacheChunks
from engine_adapters.lmcache.options import pool_address
from kvpool.chunk_format import KVLayout
from kvpool.errors import InvalidArgument
from kvpool.keys import Namespace
from kvpool.tools.launch.processes import clean_env

LAYERS, HEADS, DIM, CHUNK = 4, 2, 8, 16
ROOT = Path(__file__).parents[2]


# ---------------------------------------------------------------- engine-free


def test_plugin_urls_name_a_pool_address():
    assert pool_address("kvpool://10.0.0.5:7600") == "10.0.0.5:7600"
    assert pool_address("kvpool://pool.local:7600/anything?x=1") == "pool.local:7600"
    assert pool_address("kvpool+etcd://10.0.0.9:2379") == "etcd://10.0.0.9:2379"
    assert pool_address("kvpool://[::1]:7600") == "[::1]:7600"
    assert pool_address("external://127.0.0.1:7600/engine_adapters.lmcache.connector/?connector_name=KVPoolConnector") \
        == "127.0.0.1:7600"
    for bad in ("redis://h:1", "kvpool://h", "kvpool://user:secret@h:7600", "kvpool://h:notaport"):
        with pytest.raises(InvalidArgument):
            pool_address(bad)


def _chunks(salt: str = "") -> LMCacheChunks:
    return LMCacheChunks(Namespace("m", "w", KVLayout(LAYERS, HEADS, DIM, "bfloat16", CHUNK), 0, 1, salt))


def _kv(tokens: int, seed: int = 0) -> torch.Tensor:
    """A chunk in LMCache's KV_2LTD format, [2, layers, tokens, heads * dim]."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, LAYERS, tokens, HEADS * DIM, generator=gen).to(torch.bfloat16)


@pytest.mark.parametrize("tokens", [CHUNK, 5])
def test_lmcache_chunks_round_trip_through_the_pool(pool, tokens):
    chunks = _chunks()
    kv = _kv(tokens, seed=tokens)
    key = chunks.pool_key(f"m@1@0@{tokens:x}@bfloat16")
    pool.put(key, chunks.encode(kv, key))
    (view,) = ChunkReader(pool, chunks.layout, auth=chunks.auth).read([key], ANY_TOKENS)
    assert view is not None and view.tokens == tokens
    out = torch.zeros_like(kv)
    chunks.place(view, out)
    assert torch.equal(out, kv)
    # layer-major in the pool: layer 1's K of head 0 is LMCache's kv[0, 1, :, :DIM]
    assert torch.equal(view.as_torch()[1, 0, 0], kv[0, 1, :, :DIM])


def test_chunks_read_into_reused_buffers(pool):
    """The reader's `into=` form (what the plugin's gets use): chunks land in the caller's buffers;
    a miss, and an object too large for any chunk of the layout, are misses, not errors."""
    chunks = _chunks()
    keys = [chunks.pool_key(f"m@1@0@{i:x}@bfloat16") for i in range(3)]
    for i, k in enumerate(keys[:2]):
        pool.put(k, chunks.encode(_kv(CHUNK if i == 0 else 7, seed=i), k))
    huge = chunks.pool_key("m@1@0@ffff@bfloat16")
    pool.put(huge, bytes(chunks.layout.object_nbytes() + 1))
    buffers = [bytearray(chunks.layout.object_nbytes()) for _ in range(4)]
    reader = ChunkReader(pool, chunks.layout, auth=chunks.auth)
    views = reader.read(keys + [huge], ANY_TOKENS, into=buffers)
    assert [v is not None for v in views] == [True, True, False, False]
    for i, view in enumerate(views[:2]):
        out = torch.zeros_like(_kv(view.tokens))
        chunks.place(view, out)
        assert torch.equal(out, _kv(CHUNK if i == 0 else 7, seed=i))
    assert bytes(buffers[0][:8]) == bytes(chunks.encode(_kv(CHUNK, 0), keys[0])[:8]), "read into the caller's buffer"


def test_a_damaged_or_foreign_chunk_is_a_miss(pool, damage):
    chunks, other = _chunks(), _chunks(salt="another tenant")
    key = chunks.pool_key("m@1@0@abc@bfloat16")
    pool.put(key, chunks.encode(_kv(CHUNK), key))
    assert other.pool_key("m@1@0@abc@bfloat16") != key, "the namespace is part of the key"
    foreign = ChunkReader(pool, other.layout, auth=other.auth)
    assert foreign.read([key], ANY_TOKENS) == [None], "a chunk of another namespace is refused"
    damage(key)
    reader = ChunkReader(pool, chunks.layout, auth=chunks.auth)
    assert reader.read([key], ANY_TOKENS) == [None] and reader.damaged == 1


# ---------------------------------------------------------------- with LMCache


@pytest.fixture(scope="module")
def lmc():
    """The real lmcache package (skip where it is not installed)."""
    return pytest.importorskip("lmcache", reason="lmcache is not installed here: `make test` runs this file in "
                                                 ".venv-lmcache (`make lmcache-env`)")


@contextlib.contextmanager
def kvpool_serve(env: dict[str, str] | None = None) -> Iterator[str]:
    """A `kvpool serve` process on a free loopback port; yields its address."""
    clean = clean_env()
    proc = subprocess.Popen([sys.executable, "-c", "from kvpool.cli import main; main()", "serve", "--host", "127.0.0.1",
                             "--port", "0", "--admin-port", "0", "--dram-capacity", "128MiB"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**clean, **(env or {})})
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "kvpool serving at" in line:
                break
        else:
            pytest.fail("kvpool serve did not start:\n" + "".join(seen[-30:]))
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep its pipe drained
        yield line.rsplit(" ", 1)[-1].strip()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def served(lmc) -> Iterator[str]:
    with kvpool_serve() as address:
        yield address


@pytest.fixture(autouse=True)
def _no_ambient_credential(monkeypatch):
    for name in ("KVPOOL_AUTH_FILE", "KVPOOL_PRINCIPAL", "KVPOOL_TENANT_SALT", "KVPOOL_MASTER"):
        monkeypatch.delenv(name, raising=False)


def plugin_entry(url: str, **options) -> dict:
    """The one LMCache config entry a user adds (docs/lmcache.md), as LMCache's extra_config."""
    return {"remote_storage_plugin.kvpool.module_path": "engine_adapters.lmcache",
            "remote_storage_plugin.kvpool.class_name": "KVPoolConnectorAdapter",
            "remote_storage_plugin.kvpool.url": url,
            **{f"remote_storage_plugin.kvpool.{k}": v for k, v in options.items()}}


def lmcache_config(instance: str, url: str, **fields):
    from lmcache.v1.config import LMCacheEngineConfig

    options = fields.pop("options", {})
    return LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=0.05,
                                             lmcache_instance_id=instance, remote_storage_plugins=["kvpool"],
                                             extra_config=plugin_entry(url, **options), **fields)


def lmcache_metadata(model: str = "org/model", use_mla: bool = False, dtype=torch.bfloat16):
    from lmcache.v1.metadata import LMCacheMetadata

    return LMCacheMetadata(model_name=model, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                           kv_dtype=dtype, kv_shape=(LAYERS, 1 if use_mla else 2, CHUNK, HEADS, DIM), use_mla=use_mla,
                           chunk_size=CHUNK)


class Side:
    """One LMCache worker's view of the pool: its local CPU backend, event loop and connector,
    built as LMCache's RemoteBackend builds them (`CreateConnector` on the plugin's URL)."""

    def __init__(self, url: str, *, instance: str = "test", model: str = "org/model", **fields):
        from lmcache.v1.storage_backend.connector import CreateConnector
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        self.config = lmcache_config(instance, url, **fields)
        self.metadata = lmcache_metadata(model)
        self.cpu = LocalCPUBackend(self.config, self.metadata, "cpu")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.conn = CreateConnector("plugin://kvpool", self.loop, self.cpu, self.config, self.metadata,
                                    plugin_name="kvpool")
        self.inner = self.conn.getWrappedConnector()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def chunk(self, tokens: int = CHUNK, seed: int = 0):
        """A MemoryObj of LMCache's allocator holding a known chunk."""
        obj = self.cpu.allocate([torch.Size([2, LAYERS, tokens, HEADS * DIM])], [torch.bfloat16])
        obj.tensor.copy_(_kv(tokens, seed))
        return obj

    def put(self, key, obj) -> None:
        obj.ref_count_up()  # as LMCache's serializer does: the connector wrapper releases it after the put
        self.run(self.conn.put(key, obj))

    def close(self) -> None:
        self.run(self.conn.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.cpu.close()


@pytest.fixture
def side(served):
    made: list[Side] = []

    def make(url: str | None = None, **kw) -> Side:
        s = Side(url or f"kvpool://{served}", **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def key(h: int, model: str = "org/model", dtype=torch.bfloat16, worker: int = 0):
    from lmcache.utils import CacheEngineKey

    return CacheEngineKey(model, 1, worker, h, dtype)


def test_the_plugin_entry_is_all_lmcache_needs(side, served):
    from lmcache.v1.storage_backend.connector.instrumented_connector import InstrumentedRemoteConnector

    from engine_adapters.lmcache import KVPoolConnector

    s = side()
    assert isinstance(s.conn, InstrumentedRemoteConnector)  # what LMCache's RemoteBackend holds
    assert isinstance(s.inner, KVPoolConnector) and s.inner.address == served


def test_lmcaches_external_url_reaches_the_same_pool(side, served):
    """LMCache's older one-URL form (`remote_url: external://...`, deprecated in 0.5) builds the
    connector too, and it reads what the plugin entry's connector stored."""
    from lmcache.v1.storage_backend.connector import CreateConnector

    s = side()
    s.put(key(5), s.chunk(seed=5))
    url = f"external://{served}/engine_adapters.lmcache/?connector_name=KVPoolConnector"
    from lmcache.v1.config import LMCacheEngineConfig

    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, max_local_cpu_size=0.05, remote_url=url)
    conn = CreateConnector(url, s.loop, s.cpu, config, s.metadata)
    try:
        assert conn.getWrappedConnector().address == served
        got = s.run(conn.get(key(5)))
        assert got is not None and torch.equal(got.tensor, _kv(CHUNK, 5))
        got.ref_count_down()
    finally:
        s.run(conn.close())


def test_put_exists_get_and_miss(side):
    s = side()
    obj = s.chunk(seed=1)
    assert not s.run(s.conn.exists(key(1)))
    s.put(key(1), obj)
    assert s.run(s.conn.exists(key(1))) and s.conn.exists_sync(key(1))
    got = s.run(s.conn.get(key(1)))
    assert got is not None and got.get_shape() == obj.get_shape()
    assert torch.equal(got.tensor, obj.tensor) and got.tensor.data_ptr() != obj.tensor.data_ptr()
    got.ref_count_down()
    for other in (key(2), key(1, model="org/other"), key(1, dtype=torch.float16)):
        assert s.run(s.conn.get(other)) is None and not s.conn.exists_sync(other)
    assert s.inner.stats["put"] == 1 and s.inner.stats["hit"] == 1 and s.inner.stats["miss"] == 3


def test_batched_forms_answer_prefixes(side):
    s = side()
    objs = {h: s.chunk(seed=h) for h in (10, 11, 13)}
    for o in objs.values():
        o.ref_count_up()
    s.run(s.conn.batched_put([key(h) for h in objs], list(objs.values())))
    keys = [key(h) for h in (10, 11, 12, 13)]
    assert s.conn.batched_contains(keys) == 2
    assert s.run(s.conn.batched_async_contains("lookup-1", keys)) == 2
    got = s.run(s.conn.batched_get(keys))
    assert [g is not None for g in got] == [True, True, False, True]
    assert all(torch.equal(g.tensor, objs[h].tensor) for g, h in zip(got, (10, 11, 12, 13)) if g is not None)
    prefix = s.run(s.conn.batched_get_non_blocking("lookup-1", keys))
    assert len(prefix) == 2 and torch.equal(prefix[1].tensor, objs[11].tensor)
    for g in [*got, *prefix]:
        if g is not None:
            g.ref_count_down()


def test_a_partial_last_chunk_round_trips(side):
    s = side()
    s.put(key(20), s.chunk(tokens=5, seed=20))
    got = s.run(s.conn.get(key(20)))
    assert got is not None and tuple(got.get_shape()) == (2, LAYERS, 5, HEADS * DIM)
    assert torch.equal(got.tensor, _kv(5, 20))


def test_a_damaged_chunk_is_a_miss_then_stored_again(side, served):
    import kvpool

    s = side()
    pool_key = s.inner.chunks.pool_key(key(30).to_string())
    blob = s.inner.chunks.encode(_kv(CHUNK, 30), pool_key)
    blob[-1] ^= 0x01
    with kvpool.connect(served) as client:
        client.put(pool_key, blob)
    assert s.run(s.conn.get(key(30))) is None and s.inner.stats["damaged"] == 1
    assert not s.conn.exists_sync(key(30)), "our own damaged chunk is removed (no keyring: removal is the rule)"
    s.put(key(30), s.chunk(seed=30))
    assert torch.equal(s.run(s.conn.get(key(30))).tensor, _kv(CHUNK, 30))


def test_what_the_plugin_cannot_store_is_refused_at_start(lmc, served):
    from lmcache.v1.storage_backend.connector import CreateConnector

    from engine_adapters.lmcache import KVPoolConnector

    url = f"kvpool://{served}"
    cases = [(lmcache_config("r1", url), lmcache_metadata(use_mla=True), "MLA"),
             (lmcache_config("r2", url, remote_serde="cachegen"), lmcache_metadata(), "remote_serde"),
             (lmcache_config("r3", url, use_layerwise=True), lmcache_metadata(), "use_layerwise"),
             (lmcache_config("r4", url, options={"threads": 0}), lmcache_metadata(), "threads"),
             (lmcache_config("r5", "kvpool://someone:pw@127.0.0.1:1"), lmcache_metadata(), "credentials")]
    for config, metadata, what in cases:
        with pytest.raises(InvalidArgument, match=what):
            CreateConnector("plugin://kvpool", None, None, config, metadata, plugin_name="kvpool")
    assert KVPoolConnector  # the refusal came from the plugin, loaded through LMCache's entry


def _wait(predicate, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_storage_managers_share_chunks_through_the_pool(lmc, served):
    """LMCache's StorageManager + RemoteBackend: one stores, a fresh one (empty CPU tier) loads."""
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    url = f"kvpool://{served}"
    md = lmcache_metadata("org/sm")
    a = StorageManager(lmcache_config("sm-a", url), md, EventManager())
    b = StorageManager(lmcache_config("sm-b", url), md, EventManager())
    try:
        assert "RemoteBackend-kvpool" in a.storage_backends
        keys = [key(h, model="org/sm") for h in (40, 41, 42)]
        objs = []
        for h in (40, 41, 42):
            obj = a.allocate([torch.Size([2, LAYERS, CHUNK, HEADS * DIM])], [torch.bfloat16])
            obj.tensor.copy_(_kv(CHUNK, h))
            objs.append(obj)
        a.batched_put(keys, objs)
        _wait(lambda: b.batched_contains(keys)[0] == 3, "the chunks to reach the pool")
        hits, where = b.batched_contains(keys)
        assert list(where) == ["RemoteBackend-kvpool"], "b's own CPU tier is empty: the pool served them"
        got = b.batched_get(keys, location="RemoteBackend-kvpool")  # as LMCache's retrieve reads a block mapping
        assert all(torch.equal(g.tensor, _kv(CHUNK, h)) for g, h in zip(got, (40, 41, 42)))
    finally:
        a.close()
        b.close()


STORE_IN_ANOTHER_PROCESS = textwrap.dedent("""
    import json, sys, time, torch
    from kvpool.tools.bench import lmcache_cpu as lc
    spec = json.loads(sys.argv[1])
    md = lc.metadata(model="org/engine", chunk=spec["chunk"], layers=spec["layers"], kv_heads=spec["heads"],
                     head_dim=spec["dim"])
    eng = lc.engine("writer", lc.config("writer", chunk=spec["chunk"], kvpool_url=spec["url"]), md)
    tokens = torch.tensor(spec["tokens"])
    kv = torch.randn(2, spec["layers"], len(tokens), spec["heads"] * spec["dim"],
                     generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    eng.store(tokens, kvcaches=kv)
    remote = eng.storage_manager.storage_backends["RemoteBackend-kvpool"]
    full = [k for start, end, k in eng.token_database.process_tokens(tokens) if end - start == spec["chunk"]]
    deadline = time.monotonic() + 60
    while remote.batched_contains(full) < len(full) and time.monotonic() < deadline:
        time.sleep(0.02)  # LMCache's puts to the pool are asynchronous
    lc.close("writer")
    print("STORED")
""")


def test_a_second_engine_loads_the_prefix_another_process_stored(lmc, served):
    """LMCache's own engine end to end: tokens -> its chunk hashes -> its storage manager -> the
    plugin -> the pool; the reader is a fresh engine in this process with an empty CPU tier."""
    from kvpool.tools.bench import lmcache_cpu as lc

    tokens = list(range(500, 500 + 3 * CHUNK + 5))  # three full chunks and a partial tail
    spec = {"url": f"kvpool://{served}", "tokens": tokens, "chunk": CHUNK, "layers": LAYERS, "heads": HEADS, "dim": DIM}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", STORE_IN_ANOTHER_PROCESS, json.dumps(spec)], capture_output=True,
                          text=True, timeout=240, env=env)
    assert "STORED" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
    expected = torch.randn(2, LAYERS, len(tokens), HEADS * DIM, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)

    md = lc.metadata(model="org/engine", chunk=CHUNK, layers=LAYERS, kv_heads=HEADS, head_dim=DIM)
    eng = lc.engine("reader", lc.config("reader", chunk=CHUNK, kvpool_url=f"kvpool://{served}"), md)
    try:
        out = torch.zeros_like(expected)
        mask = eng.retrieve(torch.tensor(tokens), kvcaches=out)
        loaded = int(mask.sum())
        assert loaded == 3 * CHUNK, "every full chunk loads; LMCache does not store the partial tail by default"
        assert torch.equal(out[:, :, :loaded], expected[:, :, :loaded])
        assert not out[:, :, loaded:].any()
        other = torch.zeros_like(expected)
        assert int(eng.retrieve(torch.tensor([1] + tokens[1:]), kvcaches=other).sum()) == 0, \
            "another first token is another prefix: nothing loads"
    finally:
        lc.close("reader")


def test_tenants_never_see_each_others_chunks(lmc, tmp_path, monkeypatch):
    keyring = tmp_path / "keyring.json"
    keyring.write_text(json.dumps({"principals": {
        "node": {"role": "node", "secret": "n" * 40},
        "acme": {"role": "tenant:acme", "secret": "a" * 40},
        "beta": {"role": "tenant:beta", "secret": "b" * 40}}}))
    os.chmod(keyring, 0o600)
    with kvpool_serve({"KVPOOL_AUTH_FILE": str(keyring)}) as address:
        sides: list[Side] = []
        try:
            monkeypatch.setenv("KVPOOL_AUTH_FILE", str(keyring))

            def as_tenant(name: str) -> Side:
                monkeypatch.setenv("KVPOOL_PRINCIPAL", name)
                sides.append(Side(f"kvpool://{address}", instance=name))
                return sides[-1]

            acme, beta, acme2 = as_tenant("acme"), as_tenant("beta"), as_tenant("acme")
            acme.put(key(50), acme.chunk(seed=50))
            assert not beta.conn.exists_sync(key(50)) and beta.conn.batched_contains([key(50)]) == 0
            assert beta.run(beta.conn.get(key(50))) is None
            beta.put(key(50), beta.chunk(seed=51))  # the same LMCache key, another tenant's KV
            assert torch.equal(acme2.run(acme2.conn.get(key(50))).tensor, _kv(CHUNK, 50))
            assert torch.equal(beta.run(beta.conn.get(key(50))).tensor, _kv(CHUNK, 51))
        finally:
            for s in sides:
                s.close()


def test_the_bench_compares_kvpool_with_local_cpu_and_redis(lmc):
    """`kvpool bench lmcache --json` on a small run: every case against both baselines, in one JSON line."""
    import shutil

    if shutil.which("redis-server") is None and not Path("/usr/bin/redis-server").exists():
        pytest.skip("redis-server is not installed (make system-deps)")
    run = subprocess.run([sys.executable, "-c", "from kvpool.cli import main; main()", "bench", "lmcache", "--reps", "1",
                          "--chunks", "2", "--prefix-tokens", "256", "--json"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "LMCACHE_LOG_LEVEL": "WARNING"})
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(run.stdout.strip().splitlines()[-1])
    cases = {(r["case"], r["baseline"]) for r in doc["results"]}
    assert cases == {(c, b) for c in ("chunk_put", "chunk_get", "prefix_store", "prefix_load")
                     for b in ("lmcache_local_cpu", "lmcache_redis")}
    assert all(r["value"] > 0 and r["baseline_value"] > 0 for r in doc["results"])
    stats = doc["setup"]["kvpool_connector_stats"]
    assert stats["put"] == 2 * 2 and stats["put_failed"] == 0 and stats["hit"] == 2 * 2 and stats["miss"] == 0
    assert doc["setup"]["chunk_bytes"] == 256 * 30 * 2 * 3 * 64 * 2  # SmolLM2-135M, bfloat16
