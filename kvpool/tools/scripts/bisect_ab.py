"""A/B of two source trees' single-key 64 KiB paths, interleaved turn by turn, with Redis in the
same turns (issue 29). Not part of the package: it drives any commit's tree, old or new, with one
harness, so bench-code changes between commits do not enter the comparison.

    python -m kvpool.tools.scripts.bisect_ab TREE_A TREE_B [--reps 9] [--ops 256] [--cases get_tcp,get_shm,put_tcp]

A TREE may end in @KVPOOL_X=1,KVPOOL_Y=0: settings for that side's server and clients.

Each tree gets a worker process (PYTHONPATH=TREE) that starts that tree's `kvpool serve`
(default settings, no KVPOOL_* variables: what `kvpool bench pool` measures) and its SDK
clients (TCP forced, and same-host). The driver runs turns in the order A B R, then B A R, ...:
one turn is `--ops` gets (or puts) of 64 KiB values into a preallocated buffer; per turn it
records wall time, the client thread's CPU time and the whole server process's CPU time (POSIX
CPU clock). Medians over turns are printed, and the last line is one JSON object.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time

SIZE, KEYS = 65536, 128


def cpu_clock(pid: int):
    clock = ctypes.c_int()
    if ctypes.CDLL(None).clock_getcpuclockid(pid, ctypes.byref(clock)) != 0:
        raise OSError("clock_getcpuclockid")
    return lambda cid=clock.value: time.clock_gettime(cid)


def worker() -> None:
    import numpy as np
    import kvpool

    env = dict(os.environ)  # the driver set the KVPOOL_* settings of this side (none by default)
    proc = subprocess.Popen([sys.executable, "-c", "from kvpool.cli import main; main()", "--log-level", "WARNING",
                             "serve", "--host", "127.0.0.1", "--port", "0", "--admin-port", "0",
                             "--dram-capacity", str(1 << 30)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    line = proc.stdout.readline().strip()
    assert line.startswith("kvpool serving at "), line
    address = line.rsplit(" ", 1)[1]
    server = cpu_clock(proc.pid)
    tcp = kvpool.connect(address, use_shm=False, transports=("tcp",))
    shm = kvpool.connect(address, use_shm=True, transports=("tcp",))
    base = np.random.default_rng(7).integers(0, 256, SIZE, dtype=np.uint8)
    keys = [f"ab/get/{i}" for i in range(KEYS)]
    for i, k in enumerate(keys):
        base[:8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)
        tcp.put_from(k, base)
    out = np.zeros(SIZE, np.uint8)
    for c in (tcp, shm):
        for i, k in enumerate(keys):
            c.get_into(k, out)
            assert int.from_bytes(out[:8].tobytes(), "little") == i
    quiet, last = 0, server()  # the arena is mapped in the background: wait until the pool is idle
    while quiet < 5:
        time.sleep(0.1)
        now = server()
        quiet, last = (quiet + 1 if now - last < 0.005 else 0), now
    put_round = 0
    print("ready", flush=True)
    for cmd in sys.stdin:
        case, ops = cmd.split()
        ops = int(ops)
        client = shm if case.endswith("shm") else tcp
        if case.startswith("get"):
            seq = [keys[i % KEYS] for i in range(ops)]
            c0, s0, t0 = time.thread_time(), server(), time.perf_counter()
            for k in seq:
                client.get_into(k, out)
            t1, c1, s1 = time.perf_counter(), time.thread_time(), server()
        else:
            put_round += 1
            seq = [f"ab/put/{put_round}/{i}" for i in range(ops)]
            c0, s0, t0 = time.thread_time(), server(), time.perf_counter()
            for k in seq:
                client.put_from(k, base)
            t1, c1, s1 = time.perf_counter(), time.thread_time(), server()
            client.remove_batch(seq)
        print(json.dumps([t1 - t0, c1 - c0, s1 - s0]), flush=True)
    tcp.close(); shm.close()
    proc.terminate(); proc.wait(10)


class Redis:
    def __init__(self):
        import shutil, socket, tempfile
        import redis
        self.dir = tempfile.mkdtemp(prefix="ab-redis-")
        s = socket.socket(); s.bind(("127.0.0.1", 0)); self.port = s.getsockname()[1]; s.close()
        self.proc = subprocess.Popen([shutil.which("redis-server") or "/usr/bin/redis-server", "--port", str(self.port),
                                      "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", self.dir],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(100):
            try:
                self.c = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=30); self.c.ping(); break
            except Exception:
                time.sleep(0.1)
        self.server = cpu_clock(self.proc.pid)
        import numpy as np
        self.base = np.random.default_rng(7).integers(0, 256, SIZE, dtype=np.uint8)
        self.out = np.zeros(SIZE, np.uint8)
        self.keys = [f"ab/get/{i}" for i in range(KEYS)]
        for k in self.keys:
            self.c.set(k, memoryview(self.base))
        self.put_round = 0

    def turn(self, case: str, ops: int):
        mv = memoryview(self.out).cast("B")
        if case.startswith("get"):
            seq = [self.keys[i % KEYS] for i in range(ops)]
            c0, s0, t0 = time.thread_time(), self.server(), time.perf_counter()
            for k in seq:
                data = self.c.get(k)
                mv[:len(data)] = data
        else:
            self.put_round += 1
            seq = [f"ab/put/{self.put_round}/{i}" for i in range(ops)]
            c0, s0, t0 = time.thread_time(), self.server(), time.perf_counter()
            for k in seq:
                self.c.set(k, memoryview(self.base))
        t1, c1, s1 = time.perf_counter(), time.thread_time(), self.server()
        if not case.startswith("get"):
            self.c.delete(*seq)
        return [t1 - t0, c1 - c0, s1 - s0]

    def close(self):
        self.c.close(); self.proc.terminate(); self.proc.wait(10)


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        return worker()
    ap = argparse.ArgumentParser()
    ap.add_argument("trees", nargs=2)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--ops", type=int, default=256)
    ap.add_argument("--cases", default="get_tcp,get_shm,put_tcp")
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    import statistics as st
    names = [os.path.basename(t.rstrip("/")) for t in a.trees]  # TREE[@K=V,K=V]: KVPOOL_* settings
    if names[0] == names[1]:
        names = [n + f"#{i}" for i, n in enumerate(names)]
    workers = []
    from kvpool.tools.launch.processes import clean_env  # this tree's; a worker imports its own tree

    for t in a.trees:
        t, _, settings = t.partition("@")
        extra = dict(kv.split("=", 1) for kv in settings.split(",") if kv)
        env = clean_env(**extra, PYTHONPATH=os.path.abspath(t))
        p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"], cwd=t, env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"
        workers.append(p)
    redis = Redis()

    def run(i, case):
        if i == 2:
            return redis.turn(case, a.ops)
        p = workers[i]
        p.stdin.write(f"{case} {a.ops}\n"); p.stdin.flush()
        return json.loads(p.stdout.readline())

    result = {"bench": "bisect_ab", "trees": names, "ops_per_turn": a.ops, "reps": a.reps, "size": SIZE,
              "label": a.label, "cases": {}}
    for case in a.cases.split(","):
        turns = {n: [] for n in (*names, "redis")}
        for rep in range(a.reps + 1):  # rep 0: warm-up
            order = [0, 1, 2] if rep % 2 else [1, 0, 2]
            for i in order:
                r = run(i, case)
                if rep:
                    turns[(*names, "redis")[i]].append(r)
        rows = {}
        for n, ts in turns.items():
            rows[n] = {"ops_per_s": round(a.ops / st.median(t[0] for t in ts), 1),
                       "client_cpu_us": round(st.median(t[1] for t in ts) * 1e6 / a.ops, 1),
                       "server_cpu_us": round(st.median(t[2] for t in ts) * 1e6 / a.ops, 1),
                       "wall_us_spread": [round(min(t[0] for t in ts) * 1e6 / a.ops, 1),
                                          round(max(t[0] for t in ts) * 1e6 / a.ops, 1)]}
        for n in names:  # per-turn ratio to Redis (same rep), median
            per = [r[0] / o[0] for o, r in zip(turns[n], turns["redis"])]
            rows[n]["ratio_to_redis"] = round(st.median(per), 3)
        result["cases"][case] = rows
        for n, r in rows.items():
            print(f"{case:8} {n:28} {r}", flush=True)
    for p in workers:
        p.stdin.close(); p.wait(30)
    redis.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
