"""The router's request path before and after issue 9's changes, in one process, alternating per
request (order swapped each time) against one pool process: CPU (routing thread, whole process)
and wall time per route, cold and warm 8k-token chat prompts, as `kvpool bench router` builds them.

    mkdir /tmp/base && git archive <commit before> kvpool | tar -x -C /tmp/base
    python benchmarks/profile_router_ab.py /tmp/base 200 100000 [freeze]

"Old" is that tree's tokenizer and keys, its way of asking the pool (the asyncio client) and of
counting a worker's local prefix; "new" is this tree's `Router.route`. Every pair must decide the
same. Prints one JSON line: per case and path [mean, p50, p99] ms; how the new path's matches were
answered (inline, async) and the inline calls' durations.
"""
import asyncio, gc, importlib.util, json, os, random, statistics, sys, tempfile, time
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = sys.argv[1]; REPS = int(sys.argv[2]); CHUNKS = int(sys.argv[3]); FREEZE = len(sys.argv) > 4 and sys.argv[4] == "freeze"
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path); m = importlib.util.module_from_spec(spec); sys.modules[name] = m; spec.loader.exec_module(m); return m
old_t = load("old_tok", f"{BASE}/kvpool/router/tokenizer.py")
old_k = load("old_keys", f"{BASE}/kvpool/keys.py")
import kvpool
from transformers import AutoTokenizer
from engine_adapters.model import reference_model_path
from engine_adapters.bench.router import _sentences
from engine_adapters.serving.launcher import LocalCluster, PoolSpec
from kvpool import worker_api as wire
from kvpool.keys import chunk_keys_hex
from kvpool.router.matcher import PrefixMatcher
from kvpool.router.policy import RouteRequest, Snapshot, WorkerView
from kvpool.router.service import Router, RouterConfig
from kvpool.router.tokenizer import RouterTokenizer
from kvpool.router.workers import Workers, WorkerState
hf = AutoTokenizer.from_pretrained(reference_model_path())
args = (hf.backend_tokenizer.to_str(), hf.chat_template); kw = dict(bos_token=hf.bos_token, eos_token=hf.eos_token)
NT, OT = RouterTokenizer(*args, **kw), old_t.RouterTokenizer(*args, **kw)
ns = b"\x01" * 16
rng = random.Random(7)

def old_view(self, keys):  # the base tree's WorkerState.view
    local = 0
    for key in keys:
        if key not in self.local_keys:
            break
        local += 1
    load = self.load
    queue = max(load.prefill_queue_tokens if load else 0, self.inflight_prefill_tokens)
    active = (load.active_sequences if load else 0) + self.inflight_decodes
    return WorkerView(name=self.name, role=self.role, queue_tokens=queue, active_sequences=active,
                      kv_tokens=load.kv_tokens if load else 0, max_batch=load.max_batch if load else 32,
                      local_prefix_chunks=local)

async def main(address):
    sync = kvpool.connect(address)
    for s in range(0, CHUNKS, 1000):
        sync.put_batch([(f"{rng.getrandbits(128):032x}", b"x") for _ in range(1000)])
    router = Router(RouterConfig(pool=address))
    router.pool = await PrefixMatcher(address).connect()
    old_pool = await kvpool.connect_async(address)
    router.tokenizer, router.chunk_tokens, router.max_positions = NT, 256, 8192
    router._namespace, router.bytes_per_token = ns, 1000
    router.workers = Workers(http=None)
    system = _sentences(rng, 7000)
    sys_keys = chunk_keys_hex(ns, NT.encode_chat([{"role": "system", "content": system}]), 256)
    sync.put_batch([(k, b"x") for k in sys_keys])
    for i in range(16):
        role = "prefill" if i < 8 else "decode"
        info = wire.WorkerInfo(role=role, model_id="m", namespace=ns.hex(), chunk_tokens=256, dtype="float32", pool=address, eos_token_ids=[2])
        st = WorkerState(url=f"http://127.0.0.1:{9000 + i}", name=f"{role}-{i}", info=info)
        st.local_keys = {f"{rng.getrandbits(128):032x}" for _ in range(6000)} | set(sys_keys[: i * 2])
        router.workers.by_url[st.url] = st
    states = router.workers.serving()
    durs = []
    real = router.pool._sync.match_prefix
    def timed(keys):
        t = time.perf_counter(); n = real(keys); durs.append((time.perf_counter() - t) * 1e3); return n
    router.pool._sync.match_prefix = timed

    async def old_route(m):
        ids = OT.encode_chat(m)
        keys = old_k.chunk_keys_hex(ns, ids, 256)
        n = await old_pool.match_prefix(keys)
        req = RouteRequest(seq=1, prompt_tokens=len(ids), max_tokens=16, chunk_tokens=256, pool_prefix_chunks=n, bytes_per_token=1000)
        snap = Snapshot(tuple(old_view(s, keys) for s in states), router.cost.params(), router.targets)
        return router.policy.choose(req, snap), req

    async def new_route(m):
        p = NT.encode_chat_prompt(m)
        router._seq = 0
        d, req, _ = await router.route(p.ids, 16, u32=p.u32)
        return d, req

    if FREEZE:
        gc.collect(); gc.freeze()
    out = {}
    for case, warm in (("cold", False), ("warm", True)):
        res = {f"{w}_{k}": [] for w in ("old", "new") for k in ("thread", "proc", "wall")}
        n = REPS if warm else max(10, REPS // 5)
        for i in range(n + 4):
            m = [{"role": "system", "content": system if warm else _sentences(rng, 7000)}, {"role": "user", "content": _sentences(rng, 60)}]
            got = {}
            for w in (("old", "new") if i % 2 else ("new", "old")):
                t0, p0, w0 = time.thread_time(), time.process_time(), time.perf_counter()
                got[w] = await (old_route(m) if w == "old" else new_route(m))
                t1, p1, w1 = time.thread_time(), time.process_time(), time.perf_counter()
                if i >= 4:
                    res[f"{w}_thread"].append((t1 - t0) * 1e3); res[f"{w}_proc"].append((p1 - p0) * 1e3); res[f"{w}_wall"].append((w1 - w0) * 1e3)
                await asyncio.sleep(0.001)
            assert got["old"][0] == got["new"][0] and got["old"][1].pool_prefix_chunks == got["new"][1].pool_prefix_chunks
        out[case] = {k: [round(statistics.fmean(v), 3), round(statistics.median(v), 3), round(statistics.quantiles(v, n=100)[98], 3)] for k, v in res.items()}
    out["inline_async"] = [router.pool.inline_calls, router.pool.async_calls]
    out["inline_durs_ms"] = [round(x, 3) for x in durs]
    print(json.dumps(out))
    await old_pool.close(); await router.pool.close()
with LocalCluster(tempfile.mkdtemp(), [], PoolSpec(args=["--dram-capacity", "256MiB"])) as c:
    asyncio.run(main(c.pool_address))
