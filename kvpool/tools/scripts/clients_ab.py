"""A/B of two source trees' node under many client processes at once, Redis in the same turns
(issue 29). Not part of the package: it drives any tree with one harness.

    python -m kvpool.tools.scripts.clients_ab TREE_A TREE_B [--clients 1,4,16] [--reps 5] [--seconds 2]
        [--size 65536] [--shm]

A TREE may end in @KVPOOL_X=1,KVPOOL_Y=0: settings for that side's server and clients.

Each tree gets its own `kvpool serve` (PYTHONPATH=TREE) and, per client count, that many client
processes of that tree (SDK over TCP, or same-host with --shm); Redis gets as many redis-py
clients. Turns run A B R, B A R, ...: in a turn every client of one side runs gets of `size`
bytes into a preallocated buffer for `--seconds` from a common start. Per turn: aggregate ops/s,
the server process's CPU per op and the clients' CPU per op (POSIX CPU clocks), latencies.
Medians over turns, per-turn ratios to Redis; the last line is one JSON object.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import socket
import statistics as st
import subprocess
import sys
import tempfile
import time

KEYS = 32


def cpu_clock(pid: int):
    clock = ctypes.c_int()
    if ctypes.CDLL(None).clock_getcpuclockid(pid, ctypes.byref(clock)) != 0:
        raise OSError("clock_getcpuclockid")
    return lambda cid=clock.value: time.clock_gettime(cid)


def _value(size: int, i: int):
    import numpy as np
    v = np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)
    v[:8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)
    return v


def client() -> None:
    """--client KIND ADDRESS SIZE INDEX: one client process; commands on stdin."""
    import numpy as np
    kind, address, size, index = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    out = np.empty(size, np.uint8)
    if kind == "redis":
        import redis
        r = redis.Redis(host="127.0.0.1", port=int(address), socket_timeout=30)
        mv = memoryview(out)

        def get_into(key, buf):
            data = r.get(key)
            mv[:len(data)] = data
            return len(data)
    elif kind == "raw":  # the RPC alone, no SDK: what the SDK's layers cost
        from kvpool.messages import NodeGet
        from kvpool.rpc import RpcClient
        rpc = RpcClient(address)

        def get_into(key, buf):
            n = rpc.call(NodeGet([key])).sizes[0]
            rpc.read_payload_into(memoryview(buf)[:n])
            return n
    else:
        import kvpool
        c = kvpool.connect(address, use_shm=kind == "shm", transports=("tcp",))
        get_into = c.get_into
    keys = [f"ab/{size}/{(index + i) % KEYS}" for i in range(KEYS)]
    lat = np.empty(1 << 20, np.float32)
    print("ready", flush=True)
    for line in sys.stdin:
        start_at, seconds = map(float, line.split())
        while time.time() < start_at:
            time.sleep(0.0005)
        clock = time.perf_counter
        c0 = time.process_time()
        end = clock() + seconds
        n = 0
        while True:
            t0 = clock()
            if t0 >= end:
                break
            got = get_into(keys[n % KEYS], out)
            lat[n % lat.size] = clock() - t0
            if got != size or int.from_bytes(out[:8].tobytes(), "little") != (index + n) % KEYS:
                raise SystemExit(f"client {index}: wrong bytes on get {n}")
            n += 1
        cpu = time.process_time() - c0
        lat[:min(n, lat.size)].tofile(f"{os.environ['AB_DIR']}/lat-{os.getpid()}")
        print(json.dumps([n, cpu]), flush=True)


def serve(tree: str, env: dict) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", "from kvpool.cli import main; main()", "--log-level", "WARNING",
                             "serve", "--host", "127.0.0.1", "--port", "0", "--admin-port", "0",
                             "--dram-capacity", str(1 << 30)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=tree)
    line = proc.stdout.readline().strip()
    assert line.startswith("kvpool serving at "), line
    return proc, line.rsplit(" ", 1)[1]


def main() -> None:
    if sys.argv[1:2] == ["--client"]:
        return client()
    ap = argparse.ArgumentParser()
    ap.add_argument("trees", nargs=2)
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--size", type=int, default=65536)
    ap.add_argument("--shm", action="store_true")
    ap.add_argument("--kind", default="", help="client kind: tcp (SDK), shm (SDK same-host), raw (RpcClient)")
    ap.add_argument("--no-redis", action="store_true")
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    import numpy as np
    import redis as redis_py

    tmp = tempfile.mkdtemp(prefix="clients-ab-")
    names = [os.path.basename(t.rstrip("/").partition("@")[0]) + ("@" + t.partition("@")[2] if "@" in t else "")
             for t in a.trees]
    if names[0] == names[1]:
        names = [n + f"#{i}" for i, n in enumerate(names)]
    from kvpool.tools.launch.processes import clean_env  # this tree's; each side imports its own tree

    sides = []  # (name, env, server proc, address, server cpu clock)
    for name, t in zip(names, a.trees):
        tree, _, settings = t.partition("@")
        extra = dict(kv.split("=", 1) for kv in settings.split(",") if kv)
        env = clean_env(**extra, PYTHONPATH=os.path.abspath(tree), AB_DIR=tmp)
        proc, address = serve(tree, env)
        sides.append((name, env, proc, address, cpu_clock(proc.pid)))
        loader = subprocess.run([sys.executable, "-c", f"""
import kvpool, sys
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
from clients_ab import _value, KEYS
c = kvpool.connect({address!r}, use_shm=False, transports=("tcp",))
for i in range(KEYS):
    c.put_from(f"ab/{a.size}/{{i}}", _value({a.size}, i))
"""], env=env, cwd=tree, check=True)
    systems = list(sides)
    rproc = None
    if not a.no_redis:
        s = socket.socket(); s.bind(("127.0.0.1", 0)); rport = s.getsockname()[1]; s.close()
        rproc = subprocess.Popen([shutil.which("redis-server") or "/usr/bin/redis-server", "--port", str(rport),
                                  "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", tmp],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(100):
            try:
                rc = redis_py.Redis(host="127.0.0.1", port=rport); rc.ping(); break
            except Exception:
                time.sleep(0.1)
        for i in range(KEYS):
            rc.set(f"ab/{a.size}/{i}", memoryview(_value(a.size, i)))
        rc.close()
        env = clean_env(PYTHONPATH=os.path.abspath(a.trees[0].partition("@")[0]), AB_DIR=tmp)
        systems.append(("redis", env, rproc, str(rport), cpu_clock(rproc.pid)))
    kind = a.kind or ("shm" if a.shm else "tcp")
    result = {"bench": "clients_ab", "sides": names, "size": a.size, "kind": kind, "reps": a.reps,
              "seconds": a.seconds, "label": a.label, "load": os.getloadavg(), "counts": {}}
    for count in [int(x) for x in a.clients.split(",")]:
        procs = {}
        for name, env, _, address, _ in systems:
            ps = []
            for i in range(count):
                p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--client",
                                      "redis" if name == "redis" else kind, address, str(a.size), str(i)],
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                ps.append(p)
            for p in ps:
                assert p.stdout.readline().strip() == "ready"
            procs[name] = ps
        turns = {s[0]: [] for s in systems}
        for rep in range(a.reps + 1):  # rep 0: warm-up
            order = list(range(len(systems)))
            if rep % 2 and len(sides) == 2:
                order[0], order[1] = 1, 0
            for i in order:
                name, _, _, _, server = systems[i]
                for f in os.listdir(tmp):
                    if f.startswith("lat-"):
                        os.unlink(os.path.join(tmp, f))
                start_at = time.time() + 0.3 + 0.01 * count
                s0 = server()
                for p in procs[name]:
                    p.stdin.write(f"{start_at} {a.seconds}\n"); p.stdin.flush()
                answers = [json.loads(p.stdout.readline()) for p in procs[name]]
                s1 = server()
                n = sum(x[0] for x in answers)
                lat = np.concatenate([np.fromfile(os.path.join(tmp, f), np.float32) for f in os.listdir(tmp)
                                      if f.startswith("lat-")])
                if rep:
                    turns[name].append({"ops_s": n / a.seconds, "server_cpu_us": (s1 - s0) * 1e6 / max(n, 1),
                                        "client_cpu_us": sum(x[1] for x in answers) * 1e6 / max(n, 1),
                                        "p50_us": float(np.percentile(lat, 50)) * 1e6,
                                        "p99_us": float(np.percentile(lat, 99)) * 1e6})
        for ps in procs.values():
            for p in ps:
                p.stdin.close()
            for p in ps:
                p.wait(30)
        rows = {}
        for name, ts in turns.items():
            rows[name] = {k: round(st.median(t[k] for t in ts), 1) for k in ts[0]}
            rows[name]["ops_s_spread"] = [round(min(t["ops_s"] for t in ts)), round(max(t["ops_s"] for t in ts))]
            if "redis" in turns and name != "redis":
                rows[name]["ratio_to_redis"] = round(st.median(
                    t["ops_s"] / r["ops_s"] for t, r in zip(ts, turns["redis"])), 3)
        if len(sides) == 2:
            rows["b_over_a"] = round(st.median(b["ops_s"] / x["ops_s"] for x, b in zip(turns[names[0]],
                                                                                        turns[names[1]])), 3)
        result["counts"][count] = rows
        for name, r in rows.items():
            print(f"clients {count:3} {name:30} {r}", flush=True)
    for _, _, proc, _, _ in systems:
        proc.terminate(); proc.wait(10)
    shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
