"""Instructions executed per pool operation, client and server, counted by valgrind (callgrind):
a measure of CPU work that does not move with the machine's load, for comparing authentication
on and off (issue 27) or two trees, where CPU seconds on this shared machine spread by +-15%.

    python kvpool/tools/scripts/instr_per_op.py [--cases rpc,engine] [--auth off,on] [--ops 200]
        [--pairs 2] [--only get_tcp_64KiB,...] [--tree PATH] [--idle] [--native] [--out FILE]

    # the RPC path, auth off and on, 64 KiB and 1 MiB, put and get, TCP and same-host
    # (~4 min per case and auth mode at load 15 here; two invocations, --auth off / on, may run at once):
    python kvpool/tools/scripts/instr_per_op.py --cases rpc --out benchmarks/instr-rpc-<date>.json
    # 8 MiB gets on the transfer-engine path (grants), of another tree (a `git worktree` of an
    # older commit): that tree's kvpool is imported by the server and the client
    python kvpool/tools/scripts/instr_per_op.py --cases engine --auth on --tree /work/wt-old --out ...

Needs valgrind (`apt-get install valgrind`, its headers in /usr/include/valgrind) and a C
compiler: a 5-line library (compiled into a temporary folder) issues callgrind's client requests
(dump the counts under a label, toggle a thread's collection) from Python through ctypes.

How: `kvpool serve` runs under `valgrind --tool=callgrind --collect-atstart=no` (wrapped by
`--serve`: SIGUSR1 starts a window, SIGUSR2 ends it, dumping the counts under the label the client
wrote), and for each case a client process runs under callgrind too (`--client`). The client
connects, writes the keys its gets read, warms up, then runs windows of N, 2N, N, 2N ...
operations, starting and ending each window on both sides. Auth on: a keyring of a node and a
tenant (KVPOOL_AUTH_FILE), the client that tenant; auth off: no keyring anywhere, the per-user
one (on by default) off too (KVPOOL_LOCAL_AUTH=off), checked on both sides before a window runs
(`_keyring_in_use`; the JSON keeps what each side said). A window's count is its operations
plus a small fixed part (the first op after a pause checks its connection), so the instructions
per op are (count(2N) - count(N)) / N of neighbouring windows, one figure per pair; their spread
shows how repeatable the count is (0.1-0.5% here; 1-1.7% on the engine path, whose revocation
table grows through the run). N is a multiple of 64: a same-host reader reports its index reads
to the node every 64 gets. Both processes run with PYTHONHASHSEED=0, RPC spinning off (a poll
loop counts instructions that depend on timing, not on the work) and Python's cyclic GC off
(`--gc on` keeps it: a collection lands in whichever window, by heap history). Puts write fresh
keys, removed after each window; the client waits for the server to be idle before the next
window (a removal's work in the master's outbox thread would land in it). Gets cycle through 16
keys.

What is counted: user-space instructions of the client process (all threads) and of the server
threads that serve requests (RPC and transfer connections, the master's outbox), not those that
wake on a clock (the serve loop, the master's tick, the node's heartbeat, the accept loops),
whose count depends on how long a window lasts (`--idle`: the server's count in idle windows,
0 here). callgrind counts no kernel work: the socket copies are not in it, and they are the same
with and without authentication. Instructions are a proxy for CPU time: cache misses and other
stalls are not counted, so a change that adds memory traffic costs more time than its count
says, and a `rep movsb` (glibc's memcpy of large blocks) counts one instruction per byte or
word moved though it runs far faster (a same-host 1 MiB get reads ~1.1 M instructions, mostly
that copy).

`--native`: the same windows without valgrind, reporting CPU seconds per op instead (the client
thread's `thread_time` and the whole server process's CPU clock), for relating the two.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import glob
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from kvpool.tools.scripts.instr_callgrind import Server, _compile_lib, _count_threads, _keyring_in_use, _serve

KIB, MIB = 1 << 10, 1 << 20
ENV = {"PYTHONHASHSEED": "0", "KVPOOL_RPC_SPIN": "0", "KVPOOL_SERVER_SPIN": "0",
       # valgrind runs Python ~30x slower: a handshake or a header must not time out
       "KVPOOL_HANDSHAKE_TIMEOUT_S": "300", "KVPOOL_HEADER_TIMEOUT_S": "300", "KVPOOL_MIN_BODY_RATE": "1"}
GET_KEYS = 16
# (path, op, size): the cases of each group
CASES = {
    "rpc": [(path, op, size) for size in (64 * KIB, MIB) for path in ("tcp", "shm") for op in ("put", "get")],
    "engine": [("engine", "get", 8 * MIB)],
}


def _size_text(size: int) -> str:
    return f"{size // MIB}MiB" if size >= MIB else f"{size // KIB}KiB"


def _ops_for(size: int, base: int) -> int:
    """N for a size: `base` at 64 KiB, half of it at 1 MiB, a quarter from 8 MiB, rounded to a
    multiple of 64 (at least 64): a same-host reader reports its index reads to the node every 64
    gets (`kvpool.client.nodes.MAX_PENDING_TOUCHES`), so each window then holds as many reports."""
    n = base if size <= 64 * KIB else base // 2 if size <= MIB else base // 4
    return max(64, round(n / 64) * 64)


# ---------------------------------------------------------------------------- the client

def _settle(cpu, period: float = 0.5, quiet: float = 0.02, timeout: float = 300.0) -> None:
    """Wait until the server is idle: under 2% of a core in each of two periods in a row (work a
    request left to a background thread, such as a removal's, must not land in the next window)."""
    deadline, calm, last = time.monotonic() + timeout, 0, cpu()
    while calm < 2 and time.monotonic() < deadline:
        time.sleep(period)
        now = cpu()
        calm = calm + 1 if now - last < quiet * period else 0
        last = now


def _client(a: argparse.Namespace) -> None:
    """`--client`: one case's windows against the server at `a.address`."""
    import numpy as np

    import kvpool

    lib = ctypes.CDLL(a.lib)
    counting = bool(lib.kv_running())
    if counting:  # every thread of the client counts: this one, and any the SDK starts
        lib.kv_toggle()
        _count_threads(lib, lambda name: True)
    server = Server(a.server_pid, a.folder, counting)
    from kvpool.tools.bench.pool_process import cpu_clock

    server_cpu = cpu_clock(a.server_pid)
    credential, keyring = None, _keyring_in_use()
    if a.secret:
        from kvpool.security.keyring import Credential

        credential = Credential(a.principal, a.secret.encode())
    elif keyring != "none":  # then a connection that works shows the server asks for no proof either
        raise RuntimeError(f"auth off, but this client has a keyring ({keyring})")
    kwargs = {"use_shm": a.path == "shm", "credential": credential}
    if a.path == "engine":
        kwargs.update(data_path="engine", transports=("tcp",))
    else:
        kwargs.update(data_path="rpc")
    client = kvpool.connect(a.address, **kwargs)
    size, case = a.size, a.case
    rng = np.random.default_rng(size)
    base = rng.integers(0, 256, size, dtype=np.uint8)
    value, out = base.copy(), np.zeros(size, np.uint8)

    def fill(i: int) -> np.ndarray:
        value[:8] = np.frombuffer(int(i).to_bytes(8, "little"), np.uint8)
        return value

    def check(i: int) -> None:
        if int.from_bytes(out[:8].tobytes(), "little") != i or not np.array_equal(out[8:], base[8:]):
            raise RuntimeError(f"{case}: wrong bytes for value {i}")

    get_keys = [f"ipo/{case}/get/{i}" for i in range(GET_KEYS)]
    if a.op == "get":
        for i, key in enumerate(get_keys):
            client.put_from(key, fill(i))
        for _ in range(3):  # warm: every key read and checked
            for i, key in enumerate(get_keys):
                client.get_into(key, out)
                check(i)
    else:
        warm = [f"ipo/{case}/warm/{i}" for i in range(GET_KEYS)]
        for i, key in enumerate(warm):
            client.put_from(key, fill(i))
        client.get_into(warm[-1], out)
        check(GET_KEYS - 1)
        client.remove_batch(warm)
    if os.environ.get("KVPOOL_INSTR_GC") == "off":
        gc.collect()
        gc.disable()
    windows = []
    for w, n in enumerate(a.windows):
        label = f"{case}/w{w}/n{n}"
        keys = get_keys if a.op == "get" else [f"ipo/{case}/put/{w}/{i}" for i in range(n)]
        _settle(server_cpu)  # the last window's removals are finished (the master's outbox) before this one
        server.zero()
        if counting:
            lib.kv_dump(b"discard")
        t0, s0, c0 = time.perf_counter(), server_cpu(), time.thread_time()
        if a.op == "get":
            for i in range(n):
                client.get_into(keys[i % GET_KEYS], out)
        else:
            for i in range(n):
                client.put_from(keys[i], fill(i))
        c1, s1, t1 = time.thread_time(), server_cpu(), time.perf_counter()
        if counting:
            lib.kv_dump(("client:" + label).encode())
        server.dump("server:" + label)
        if a.op == "get":
            check((n - 1) % GET_KEYS)
        else:
            client.get_into(keys[-1], out)
            check(n - 1)
            client.remove_batch(keys)
        windows.append({"label": label, "ops": n, "wall_s": t1 - t0, "client_cpu_s": c1 - c0,
                        "server_cpu_s": s1 - s0})
    if a.op == "get":
        client.remove_batch(get_keys)
    client.close()
    with open(os.path.join(a.folder, f"client-{case.replace('/', '_')}.json"), "w") as f:
        json.dump({"case": case, "counting": counting, "keyring": keyring, "windows": windows}, f)


# ---------------------------------------------------------------------------- the driver

def _keyring(folder: str) -> tuple[str, str]:
    """A keyring file (0600) of a node and one tenant ("bench"); returns (path, tenant secret)."""
    from kvpool.tools.bench.pool_process import write_bench_keyring

    return write_bench_keyring(folder)


def _valgrind(out_pattern: str) -> list[str]:
    return ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_pattern}", "--dump-line=no",
            "--collect-atstart=no"]


def _read_dumps(pattern: str) -> dict[str, int]:
    """label -> instructions, from the callgrind dumps matching `pattern`."""
    found = {}
    for path in glob.glob(pattern):
        label = ir = None
        with open(path, errors="replace") as f:
            for line in f:
                if line.startswith("desc: Trigger: Client Request: "):
                    label = line.split(": ", 3)[3].strip()
                elif line.startswith("summary:"):
                    ir = int(line.split()[1])
                    break
        if label is not None and ir is not None:
            found[label] = ir
    return found


def _per_op(windows: list[dict], key: str) -> dict:
    """Instructions (or CPU s) per op from neighbouring N / 2N windows: median, each pair, and
    the per-window naive figure (count / ops)."""
    pairs = []
    for first, second in zip(windows, windows[1:]):
        if second["ops"] != first["ops"]:
            small, big = sorted((first, second), key=lambda w: w["ops"])
            pairs.append((big[key] - small[key]) / (big["ops"] - small["ops"]))
    med = statistics.median(pairs)
    return {"per_op": med, "pairs": pairs,
            "rel_spread": (max(pairs) - min(pairs)) / med if med else None,
            "naive": [w[key] / w["ops"] for w in windows]}


def _child_env(folder: str, auth: bool, tree: str | None = None, gc_mode: str = "off") -> tuple[dict[str, str], str]:
    """The server's and the clients' environment, and the tenant's secret ("" with auth off):
    auth on, a keyring in `folder`; auth off, no keyring at all, neither a configured one nor
    this user's own (on by default, and `clean_env` passes on where it is)."""
    from kvpool.security.local import DIR_ENV, LOCAL_ENV
    from kvpool.tools.launch.processes import clean_env

    env = clean_env(**ENV)
    if tree:
        env["PYTHONPATH"] = os.path.abspath(tree)
    env["KVPOOL_INSTR_GC"] = gc_mode
    secret = ""
    if auth:
        env["KVPOOL_AUTH_FILE"], secret = _keyring(folder)
    else:
        env.pop(DIR_ENV, None)
        env[LOCAL_ENV] = "off"
    return env, secret


def _group(a: argparse.Namespace, folder: str, lib: str, auth: bool) -> dict:
    """One server (with a keyring or not) and a client process per case."""
    env, secret = _child_env(folder, auth, a.tree, a.gc)
    tag = "on" if auth else "off"
    counting = not a.native
    script = os.path.abspath(__file__)
    cases = [c for g in a.cases.split(",") for c in CASES[g]
             if not a.only or any(o in f"{c[1]}_{c[0]}_{_size_text(c[2])}" for o in a.only.split(","))]
    capacity = max(512 * MIB, max(4 * _ops_for(s, a.ops) * s if op == "put" else 2 * GET_KEYS * s
                                  for _, op, s in cases))
    cmd = [sys.executable, script, "--serve", folder, "--lib", lib, "--", "serve", "--host", "127.0.0.1",
           "--port", "0", "--admin-port", "0", "--dram-capacity", str(capacity)]
    if counting:
        cmd = _valgrind(os.path.join(folder, f"server-{tag}.%p")) + cmd
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(os.path.join(folder, f"server-{tag}.log"), "w"),
                            text=True, env=env)
    results: dict[str, dict] = {}
    try:
        line = proc.stdout.readline().strip()
        if not line.startswith("kvpool serving at "):
            raise RuntimeError(f"kvpool serve did not start (said {line!r}); see {folder}")
        address = line.rsplit(" ", 1)[1]
        with open(os.path.join(folder, "keyring")) as f:
            server_keyring = f.read()
        if server_keyring != ("configured" if auth else "none"):
            raise RuntimeError(f"auth {tag}, but the server's keyring is {server_keyring!r}")
        print(f"auth {tag}: server keyring {server_keyring}", file=sys.stderr, flush=True)
        time.sleep(2 if not counting else 10)  # the arena's pages mapped (a background thread)
        if a.idle and counting:
            srv = Server(proc.pid, folder, True)
            for seconds in (5, 10):
                srv.zero()
                time.sleep(seconds)
                srv.dump(f"server:idle-{tag}/{seconds}s")
        for path, op, size in cases:
            n = _ops_for(size, a.ops)
            case = f"{op}_{path}_{_size_text(size)}_auth-{tag}"
            windows = [n, 2 * n] * a.pairs
            ccmd = [sys.executable, script, "--client", "--folder", folder, "--lib", lib, "--address", address,
                    "--server-pid", str(proc.pid), "--case", case, "--path", path, "--op", op, "--size", str(size),
                    "--windows", ",".join(map(str, windows)), "--secret", secret, "--principal", "bench"]
            if counting:
                ccmd = _valgrind(os.path.join(folder, f"client-{case}.%p")) + ccmd
            t0 = time.monotonic()
            done = subprocess.run(ccmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"client {case} failed:\n{done.stdout[-3000:]}")
            with open(os.path.join(folder, f"client-{case}.json")) as f:
                doc = json.load(f)
            results[case] = {"path": path, "op": op, "size": size, "auth": auth,
                             "keyring": {"server": server_keyring, "client": doc["keyring"]}, "windows": doc["windows"],
                             "took_s": round(time.monotonic() - t0, 1)}
            print(f"  {case}: {results[case]['took_s']} s", file=sys.stderr, flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if counting:
        dumps = _read_dumps(os.path.join(folder, f"server-{tag}.*")) | _read_dumps(os.path.join(folder, "client-*.[0-9]*"))
        for case, r in results.items():
            for w in r["windows"]:
                w["client_ir"] = dumps[f"client:{w['label']}"]
                w["server_ir"] = dumps[f"server:{w['label']}"]
                w["both_ir"] = w["client_ir"] + w["server_ir"]
            for side in ("client", "server", "both"):
                r[f"{side}_ir"] = _per_op(r["windows"], f"{side}_ir")
        for label, ir in dumps.items():
            if label.startswith("server:idle-"):
                results.setdefault("idle", {})[label.split(":", 1)[1]] = ir
    for case, r in results.items():
        if case != "idle":
            for side in ("client", "server"):
                r[f"{side}_cpu_us"] = round(statistics.median(w[f"{side}_cpu_s"] / w["ops"] for w in r["windows"]) * 1e6, 1)
    return results


def _table(results: dict) -> list[str]:
    """One line per case: per op, instructions (or CPU us with --native) of each side, and with
    both auth modes run, auth off -> on and the change."""
    lines = []
    for case, r in results.items():
        if case == "idle" or (r["auth"] and case.replace("_auth-on", "_auth-off") in results):
            continue
        on = results.get(case.replace("_auth-off", "_auth-on")) if not r["auth"] else None
        row = f"{case:28s}"
        for side in ("client", "server", "both"):
            def value(x: dict) -> float | None:
                if f"{side}_ir" in x:
                    return x[f"{side}_ir"]["per_op"]
                cpu = [x.get(f"{s}_cpu_us") for s in (("client", "server") if side == "both" else (side,))]
                return sum(cpu) if None not in cpu else None
            o = value(r)
            if o is None:
                continue
            row += f" {side} {o:12,.0f}"
            if on is not None and o:
                row += f" -> {value(on):12,.0f} ({value(on) / o - 1:+.2%})"
        lines.append(row)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="rpc", help="groups of cases: rpc, engine (comma-separated)")
    ap.add_argument("--auth", default="off,on",
                    help="which pools: off (no keyring, the per-user one off too), on (keyring, tenant client)")
    ap.add_argument("--ops", type=int, default=200, help="N at 64 KiB (N/2 at 1 MiB, N/4 at 8 MiB)")
    ap.add_argument("--pairs", type=int, default=2, help="N / 2N window pairs per case")
    ap.add_argument("--tree", help="import kvpool from this tree (a worktree of another commit)")
    ap.add_argument("--native", action="store_true", help="no valgrind: CPU seconds per op only")
    ap.add_argument("--idle", action="store_true", help="also count each server's instructions while idle")
    ap.add_argument("--gc", choices=("off", "on"), default="off",
                    help="Python's cyclic garbage collector in both processes (off: see the docstring)")
    ap.add_argument("--only", help="only the cases whose name (e.g. get_tcp_64KiB) holds one of these (comma-separated)")
    ap.add_argument("--keep", action="store_true", help="keep the callgrind files (for callgrind_annotate)")
    ap.add_argument("--out", help="write the results here (JSON)")
    # internal: the server wrapper and the client process
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    for name in ("--folder", "--lib", "--address", "--case", "--path", "--op", "--secret", "--principal"):
        ap.add_argument(name, help=argparse.SUPPRESS)
    ap.add_argument("--server-pid", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--size", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--windows", type=lambda s: [int(x) for x in s.split(",")], help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args()
    if args.serve:
        _serve(args.serve, args.lib, [r for r in rest if r != "--"])
        return
    if args.client:
        _client(args)
        return
    if not args.native and shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed (apt-get install valgrind), or use --native")
    folder = tempfile.mkdtemp(prefix="kvpool-instr-")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the server and clean up when told to stop
    try:
        lib = _compile_lib(folder)
        results: dict[str, dict] = {}
        for tag in args.auth.split(","):
            print(f"auth {tag} ...", file=sys.stderr, flush=True)
            for case, r in _group(args, folder, lib, tag == "on").items():
                if case == "idle":
                    results.setdefault("idle", {}).update(r)
                else:
                    results[case] = r
        head = subprocess.run(["git", "-C", args.tree or os.path.dirname(os.path.abspath(__file__)), "rev-parse",
                               "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        doc = {"script": "kvpool/tools/scripts/instr_per_op.py", "argv": sys.argv[1:], "commit": head,
               "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H%MZ"),
               "measure": "cpu" if args.native else "callgrind instructions", "results": results}
        for line in _table(results):
            print(line)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(doc, f, indent=1)
    finally:
        if args.keep:
            print(f"callgrind files kept in {folder}", file=sys.stderr)
        else:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
