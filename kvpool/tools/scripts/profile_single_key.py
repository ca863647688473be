"""What one single-key put / get_into costs, client and server, in figures that do not depend on
the machine's load: Python calls per op (cProfile) and CPU time per op (the client thread's and
the server connection thread's user + system time, `getrusage(RUSAGE_THREAD)`), for BENCHMARKS.md.

    python kvpool/tools/scripts/profile_single_key.py [--mode cpu|calls] [--sizes 64KiB,1MiB] [--auth] [--out FILE]
    python kvpool/tools/scripts/profile_single_key.py --pair [--control | --principal node] [--rounds 30] [--round 100]

Starts `kvpool serve` (1 GiB DRAM) in a child process whose finished threads report their
cProfile and CPU time (`--serve`, internal), and drives it over TCP (use_shm=False) and the
same-host path (unix socket, shm reads), one fresh client connection per (path, size, op), so
the server's figures are that connection's thread alone. RPC spinning is off on both sides
(KVPOOL_RPC_SPIN=0, KVPOOL_SERVER_SPIN=0): CPU time is then the work and its syscalls, not
polling. `--auth`: the pool has a keyring (a node and one tenant) and the client is the tenant.
To compare two trees, run it once per tree with PYTHONPATH pointing at each.

`--pair` (CPU only): authentication's cost measured in one sitting. Two pools, one without a
keyring and one with (started alike, each measured once idle), and a client of each (the
second a tenant); short rounds of `--round` ops alternate between them, A B then B A, and each
round's CPU per op is the client thread's and the whole server process's (its POSIX CPU clock).
Reported: the medians per op, and the median of the per-round ratios with / without (client +
server CPU): on a loaded machine two runs minutes apart differ by more than authentication
costs, two rounds side by side do not. `--control`: the second pool has no keyring either, so
the ratio shows what the method reads when there is no difference (its floor). `--principal
node`: the keyring pool's client proves the node principal (authorized, keys not scoped), to
tell the tenant's key scoping from the rest of authentication.

"Without a keyring" holds only with this user's own keyring off too (it is on by default): run
with KVPOOL_LOCAL_AUTH=off, or the plain pool and its client authenticate with it.
`instr_per_op.py` turns it off by itself and is what BENCHMARKS.md quotes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

NO_SPIN = {"KVPOOL_RPC_SPIN": "0", "KVPOOL_SERVER_SPIN": "0"}
OPS = {"cpu": 2000, "calls": 300}  # 64 KiB ops per case; fewer for larger sizes (same bytes, at least 100)


def _serve(out: str, mode: str) -> None:
    """`kvpool serve`, each finished thread's profile and CPU time kept; SIGUSR1 writes and clears them."""
    import cProfile
    import pstats
    import resource
    import threading

    done: list = []
    run = threading.Thread.run

    def profiled(self: threading.Thread) -> None:
        prof = cProfile.Profile() if mode == "calls" else None
        if prof is not None:
            prof.enable()
        try:
            run(self)
        finally:
            if prof is not None:
                prof.disable()
            ru = resource.getrusage(resource.RUSAGE_THREAD)
            if self.name != "kvpool-populate":  # mapping the arena at start-up: no op's work
                done.append((prof, ru.ru_utime + ru.ru_stime))

    def dump(*_: object) -> None:
        items = list(done)
        done.clear()
        calls = 0
        profs = [p for p, _ in items if p is not None]
        if profs:
            stats = pstats.Stats(profs[0])
            for p in profs[1:]:
                stats.add(p)
            calls = sum(v[1] for v in stats.stats.values())
        with open(out, "w") as f:
            json.dump({"cpu_s": sum(c for _, c in items), "calls": calls}, f)

    threading.Thread.run = profiled
    signal.signal(signal.SIGUSR1, dump)
    from kvpool.cli import main

    sys.argv = ["kvpool", "--log-level", "WARNING", "serve", "--host", "127.0.0.1", "--port", "0", "--admin-port", "0",
                "--dram-capacity", str(1 << 30)]
    main()


def _server_figures(proc: subprocess.Popen, out: str) -> dict:
    time.sleep(0.3)  # the connection's thread ends after the client closes
    os.kill(proc.pid, signal.SIGUSR1)
    for _ in range(100):
        time.sleep(0.05)
        try:
            with open(out) as f:
                doc = json.load(f)
            os.unlink(out)
            return doc
        except (OSError, ValueError):
            continue
    raise RuntimeError("the server did not report")


def _pair(args: argparse.Namespace) -> dict:
    """`--pair`: see the module's docstring."""
    import statistics
    import threading

    import numpy as np

    import kvpool
    from kvpool.tools.bench.pool_process import PoolProcess, auth_pool
    from kvpool.config import parse_size

    os.environ.update(NO_SPIN)
    plain = PoolProcess(1 << 30, settings=NO_SPIN)
    if args.control:  # the method's floor: the second pool has no keyring either
        secured, credential = PoolProcess(1 << 30, settings=NO_SPIN), None
        cleanup = secured.close
    else:
        secured, credential, cleanup = auth_pool(1 << 30, settings=NO_SPIN, principal=args.principal)
    results: dict[str, dict] = {}
    try:
        for shm in (False, True):
            path = "shm" if shm else "tcp"
            for text in args.sizes.split(","):
                size = parse_size(text)
                n = max(8, args.round * (64 << 10) // max(size, 64 << 10))
                value = np.random.default_rng(1).integers(0, 255, size, dtype=np.uint8)
                out = np.empty(size, np.uint8)
                sides = [(plain, kvpool.connect(plain.address, use_shm=shm)),
                         (secured, kvpool.connect(secured.address, use_shm=shm, credential=credential))]
                try:
                    get_keys = [f"pair/{path}/{size}/get/{i}" for i in range(n)]
                    for _, c in sides:  # warm (imports, first faults), and the keys the gets read
                        for key in get_keys:
                            c.put_from(key, value)
                            c.get_into(key, out)
                    for t in threading.enumerate():
                        if t.name == "kvpool-populate":
                            t.join(120)
                    plain.settle()
                    secured.settle()
                    for op in ("put", "get"):
                        turns: list[list[tuple[float, float]]] = [[], []]
                        for r in range(args.rounds):
                            for side in ((0, 1) if r % 2 == 0 else (1, 0)):
                                server, c = sides[side]
                                keys = get_keys if op == "get" else [f"pair/{path}/{size}/{r}/{i}" for i in range(n)]
                                t0, s0 = time.thread_time(), server.cpu_seconds()
                                for key in keys:
                                    if op == "put":
                                        c.put_from(key, value)
                                    else:
                                        c.get_into(key, out)
                                t1, s1 = time.thread_time(), server.cpu_seconds()
                                turns[side].append(((t1 - t0) / n * 1e6, (s1 - s0) / n * 1e6))
                                if op == "put":
                                    c.remove_batch(keys)
                        ratios = [(on[0] + on[1]) / (off[0] + off[1]) for off, on in zip(*turns)]
                        med = [[round(statistics.median(x[i] for x in t), 1) for i in (0, 1)] for t in turns]
                        results[f"{op}_{path}_{text}"] = {
                            "client_cpu_us": med[0][0], "server_cpu_us": med[0][1],
                            "auth_client_cpu_us": med[1][0], "auth_server_cpu_us": med[1][1],
                            "auth_cpu_ratio": round(statistics.median(ratios), 3),
                            "ratio_spread": [round(min(ratios), 3), round(max(ratios), 3)]}
                finally:
                    for _, c in sides:
                        c.close()
    finally:
        plain.close()
        cleanup()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("cpu", "calls"), default="cpu")
    ap.add_argument("--sizes", default="64KiB,1MiB")
    ap.add_argument("--auth", action="store_true", help="a pool with a keyring, the client a tenant of it")
    ap.add_argument("--out", help="also write the figures here (JSON)")
    ap.add_argument("--pair", action="store_true", help="CPU with / without a keyring, alternating rounds")
    ap.add_argument("--control", action="store_true", help="--pair: the second pool without a keyring too (A/A)")
    ap.add_argument("--principal", choices=("bench", "node"), default="bench",
                    help="--pair: who the keyring pool's client is: the tenant (keys scoped) or the node (not scoped)")
    ap.add_argument("--rounds", type=int, default=30, help="--pair: rounds per side")
    ap.add_argument("--round", type=int, default=100, help="--pair: 64 KiB ops per round (fewer for larger)")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        _serve(args.serve, args.mode)
        return
    if args.pair:
        results = _pair(args)
        for case, figures in results.items():
            print(f"{case:16s} {figures}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"mode": "pair", "results": results}, f, indent=1)
        return
    import cProfile
    import pstats
    import resource
    import threading

    import numpy as np

    import kvpool
    from kvpool.config import parse_size

    os.environ.update(NO_SPIN)
    report = f"/tmp/kvpool-profile-{os.getpid()}.json"
    from kvpool.tools.launch.processes import clean_env

    env = clean_env(**NO_SPIN)
    credential = None
    if args.auth:
        import secrets
        import tempfile

        from kvpool.security.keyring import Credential

        folder = tempfile.mkdtemp(prefix="kvpool-profile-auth-")
        env["KVPOOL_AUTH_FILE"] = keyring = os.path.join(folder, "keyring.toml")
        node, tenant = secrets.token_hex(24), secrets.token_hex(24)
        with os.fdopen(os.open(keyring, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(f'[principals.node]\nrole = "node"\nsecret = "{node}"\n'
                    f'[principals.bench]\nrole = "tenant:bench"\nsecret = "{tenant}"\n')
        credential = Credential("bench", tenant.encode())
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--mode", args.mode, "--serve", report],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    line = proc.stdout.readline().strip()
    if not line.startswith("kvpool serving at "):
        proc.kill()
        raise SystemExit(f"kvpool serve did not start (said {line!r})")
    address = line.rsplit(" ", 1)[1]
    results: dict[str, dict] = {}
    try:
        for shm in (False, True):
            path = "shm" if shm else "tcp"
            for text in args.sizes.split(","):
                size = parse_size(text)
                n = max(100, OPS[args.mode] * (64 << 10) // max(size, 64 << 10))
                value = np.random.default_rng(1).integers(0, 255, size, dtype=np.uint8)
                out = np.empty(size, np.uint8)
                keys = [f"profile/{path}/{size}/{i}" for i in range(n)]
                with kvpool.connect(address, use_shm=shm, credential=credential) as c:  # warm: imports, first faults
                    for i in range(20):
                        c.put_from(f"warm/{path}/{size}/{i}", value)
                        c.get_into(f"warm/{path}/{size}/{i}", out)
                _server_figures(proc, report)
                for t in threading.enumerate():  # the shm client maps the arena in the background
                    if t.name == "kvpool-populate":
                        t.join(120)
                for op in ("put", "get"):
                    c = kvpool.connect(address, use_shm=shm, credential=credential)
                    prof = cProfile.Profile() if args.mode == "calls" else None
                    r0 = resource.getrusage(resource.RUSAGE_THREAD)
                    if prof is not None:
                        prof.enable()
                    for key in keys:
                        if op == "put":
                            c.put_from(key, value)
                        else:
                            c.get_into(key, out)
                    if prof is not None:
                        prof.disable()
                    r1 = resource.getrusage(resource.RUSAGE_THREAD)
                    c.close()
                    server = _server_figures(proc, report)
                    case = results[f"{op}_{path}_{text}"] = {}
                    if args.mode == "calls":
                        case["client_calls"] = round(sum(v[1] for v in pstats.Stats(prof).stats.values()) / n, 1)
                        case["server_calls"] = round(server["calls"] / n, 1)
                    else:
                        cpu = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
                        case["client_cpu_us"] = round(cpu / n * 1e6, 1)
                        case["server_cpu_us"] = round(server["cpu_s"] / n * 1e6, 1)
                with kvpool.connect(address, use_shm=shm, credential=credential) as c:
                    c.remove_batch(keys)
                _server_figures(proc, report)
    finally:
        proc.terminate()
        proc.wait(10)
        if args.auth:
            import shutil

            shutil.rmtree(os.path.dirname(env["KVPOOL_AUTH_FILE"]), ignore_errors=True)
    for case, figures in results.items():
        print(f"{case:16s} {figures}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"mode": args.mode, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
