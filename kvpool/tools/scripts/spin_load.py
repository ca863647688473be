"""Many-client load against `kvpool serve`, RPC spinning on (defaults) or off, for BENCHMARKS.md.

    python kvpool/tools/scripts/spin_load.py --clients 1,4,16 [--shm] [--seconds 8]

For each client count, runs `kvpool serve` (4 GiB DRAM) twice, spinning off
(KVPOOL_SERVER_SPIN=0, KVPOOL_RPC_SPIN=0) and on (the defaults), in alternating order, with that
many client processes each alternating a 64 KiB put and a get of it for `--seconds`; prints
ops/s and p50/p99 latency of each. `--shm`: same-host clients (unix socket, shm reads);
default: TCP-only clients (use_shm=False).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import time

OFF = {"KVPOOL_SERVER_SPIN": "0", "KVPOOL_RPC_SPIN": "0"}


def _client(addr: str, idx: int, shm: bool, seconds: float, env: dict, q) -> None:
    os.environ.update(env)
    import kvpool

    c = kvpool.connect(addr, use_shm=shm, data_path="rpc")
    value = os.urandom(64 << 10)
    lat, i, end = [], 0, time.time() + seconds
    while time.time() < end:
        t = time.perf_counter()
        if i % 2 == 0:
            c.put(f"c{idx}-{i}", value)
        else:
            assert c.get(f"c{idx}-{i - 1}") == value
        lat.append(time.perf_counter() - t)
        i += 1
    c.close()
    q.put(lat)


def run(clients: int, spin: bool, shm: bool, seconds: float) -> str:
    import socket

    env = {} if spin else OFF
    with socket.socket() as s:  # a free port for the server
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = os.path.join(os.path.dirname(sys.executable), "kvpool")
    from kvpool.tools.launch.processes import clean_env

    srv_env = clean_env(**env)
    srv = subprocess.Popen([exe, "serve", "--port", str(port), "--admin-port", "0", "--dram-capacity", "4GiB"],
                           env=srv_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(3)
        q = mp.get_context("spawn").Queue()
        procs = [mp.get_context("spawn").Process(target=_client, args=(f"127.0.0.1:{port}", i, shm, seconds, env, q))
                 for i in range(clients)]
        for p in procs:
            p.start()
        lats = sorted(x for _ in procs for x in q.get())
        for p in procs:
            p.join()
    finally:
        srv.terminate()
        srv.wait()
    n = len(lats)
    return (f"{'shm' if shm else 'tcp'} clients={clients} spin={'on' if spin else 'off'}: {n / seconds:,.0f} ops/s, "
            f"p50 {lats[n // 2] * 1e6:.0f} us, p99 {lats[int(n * 0.99)] * 1e6:.0f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="1,4,16", help="client counts, comma-separated")
    ap.add_argument("--shm", action="store_true", help="same-host clients (unix socket + shm reads)")
    ap.add_argument("--seconds", type=float, default=8.0)
    args = ap.parse_args()
    for i, n in enumerate(int(x) for x in args.clients.split(",")):
        for spin in ((False, True) if i % 2 == 0 else (True, False)):
            print(run(n, spin, args.shm, args.seconds), flush=True)


if __name__ == "__main__":
    main()
