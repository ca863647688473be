"""A/B of two source trees: 64 KiB gets on one connection while another client process loops
8 MiB gets, over TCP (issue 29: one big get must not stall every other client's small ones).

    python kvpool/tools/scripts/big_beside_small.py TREE_A TREE_B

Each turn starts a `kvpool serve` of one tree, puts the two values, then runs the big getter
for 3.5 s and the small getter for 3 s beside it; turns alternate A B, B A, A B. Per turn: small
gets done, their p50/p99/max latency (us), big gets done. Not part of the package.
"""
import json, os, subprocess, sys, time
import numpy as np

def serve(tree):
    env = dict(os.environ, PYTHONPATH=tree)
    p = subprocess.Popen([sys.executable, "-c", "from kvpool.cli import main; main()", "--log-level", "WARNING", "serve",
                          "--host", "127.0.0.1", "--port", "0", "--admin-port", "0", "--dram-capacity", str(256 << 20)],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=tree)
    return p, p.stdout.readline().strip().rsplit(" ", 1)[1]

BIG = """
import sys, time, numpy as np, kvpool
c = kvpool.connect(sys.argv[1], use_shm=False, transports=("tcp",))
out = np.empty(8 << 20, np.uint8); n = 0; end = time.time() + float(sys.argv[2])
while time.time() < end:
    c.get_into("big", out); n += 1
print(n)
"""
SMALL = """
import sys, time, json, numpy as np, kvpool
c = kvpool.connect(sys.argv[1], use_shm=False, transports=("tcp",))
out = np.empty(65536, np.uint8); lat = []; end = time.time() + float(sys.argv[2])
time.sleep(0.3)
while time.time() < end:
    t0 = time.perf_counter(); c.get_into("small", out); lat.append(time.perf_counter() - t0)
a = np.array(lat) * 1e6
print(json.dumps([len(a), float(np.percentile(a, 50)), float(np.percentile(a, 99)), float(a.max())]))
"""
res = {}
trees = sys.argv[1:3]
for turn in range(3):
    for tree in (trees if turn % 2 == 0 else trees[::-1]):
        p, addr = serve(tree)
        env = dict(os.environ, PYTHONPATH=tree)
        subprocess.run([sys.executable, "-c", f"""
import numpy as np, kvpool
c = kvpool.connect({addr!r}, use_shm=False, transports=("tcp",))
c.put_from("big", np.ones(8 << 20, np.uint8)); c.put_from("small", np.ones(65536, np.uint8))
"""], env=env, check=True, cwd=tree)
        big = subprocess.Popen([sys.executable, "-c", BIG, addr, "3.5"], env=env, stdout=subprocess.PIPE, text=True, cwd=tree)
        small = subprocess.run([sys.executable, "-c", SMALL, addr, "3"], env=env, capture_output=True, text=True, cwd=tree)
        bigs = int(big.communicate()[0])
        n, p50, p99, mx = json.loads(small.stdout)
        res.setdefault(tree, []).append({"small_gets": n, "p50_us": round(p50), "p99_us": round(p99), "max_us": round(mx), "big_gets": bigs})
        p.terminate(); p.wait(10)
print(json.dumps({"load": os.getloadavg(), "results": res}))
