"""Does an idle master's memory creep? One etcd, one master, one node, no client, for `--minutes`.

    python -m kvpool.tools.scripts.idle_heap --minutes 60 --out /tmp/heap --variant plain
    python -m kvpool.tools.scripts.idle_heap --minutes 60 --out /tmp/heap --variant arena2 \
        --env MALLOC_ARENA_MAX=2
    python -m kvpool.tools.scripts.idle_heap --report /tmp/heap/plain.jsonl [/tmp/heap/arena2.jsonl ...]

The master runs inside a child of this script (`--child`: `MasterServer` plus a sampler thread),
so the sampler sees the master's own allocator: every `--period` seconds it appends one JSON line
with VmRSS / RssAnon (/proc/self/status), glibc's `mallinfo2()` (bytes in use, free in the
heap, mmapped), the number of malloc arenas (`malloc_info`), anonymous mappings from
/proc/self/smaps (count, bytes, the `[heap]`), thread count, `sys.getallocatedblocks()`, the
number of gc-tracked objects, and with `--tracemalloc` the traced Python bytes (the top growth
by line is written at the end). `--admin` also serves the REST admin API, as `kvpool master`
does by default; `--trim` calls malloc_trim(0) after each sample (what the allocator could give
back); `--bare` runs, instead of a master, only a standby's etcd traffic in one thread;
`--read-bytes N` sets httpcore's socket read size (it was the cause, see kvpool/cluster/etcd.py).
`--report` prints each series' growth in MiB/h (least squares over the whole run and over its
second half).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MIB = 1 << 20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        libc.fopen.restype = ctypes.c_void_p
        libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
        libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.fclose.argtypes = [ctypes.c_void_p]
        return libc
    except (OSError, AttributeError):  # not glibc (or older than 2.33): no allocator figures
        return None


def _arenas(libc) -> list[tuple[int, int]]:
    """(bytes from the system, bytes free in it) of each malloc arena, from malloc_info's XML."""
    with tempfile.NamedTemporaryFile("r", suffix=".xml") as tmp:
        fp = libc.fopen(tmp.name.encode(), b"w")
        libc.malloc_info(0, fp)
        libc.fclose(fp)
        xml = open(tmp.name).read()
    out = []
    for heap in re.findall(r"<heap nr=.*?</heap>", xml, re.S):
        current = re.search(r'<system type="current" size="(\d+)"', heap)
        free = sum(int(n) for n in re.findall(r'<total type="(?:fast|rest)" count="\d+" size="(\d+)"', heap))
        out.append((int(current.group(1)) if current else 0, free))
    return out


def _smaps_anon() -> dict:
    """Private anonymous memory by mapping kind: the brk heap, other anonymous mappings (malloc
    arenas, thread stacks, mmapped blocks)."""
    heap = anon = count = 0
    name = ""
    for line in open("/proc/self/smaps"):
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            parts = line.split()
            name = parts[5] if len(parts) > 5 else ""
        elif line.startswith("Anonymous:"):
            kib = int(line.split()[1])
            if name == "[heap]":
                heap += kib
            elif name == "" and kib:
                anon += kib
                count += 1
    return {"heap_brk_mib": round(heap / 1024, 3), "anon_maps_mib": round(anon / 1024, 3), "anon_maps": count}


def sample(libc, traced: bool) -> dict:
    status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
    out = {"t": time.time(), "rss_mib": int(status["VmRSS"].split()[0]) / 1024,
           "anon_mib": int(status["RssAnon"].split()[0]) / 1024, "threads": int(status["Threads"]),
           "py_blocks": sys.getallocatedblocks(), "gc_objects": len(gc.get_objects())}
    out.update(_smaps_anon())
    if libc is not None:
        mi = libc.mallinfo2()
        arenas = _arenas(libc)
        out.update({"malloc_used_mib": mi.uordblks / MIB, "malloc_free_mib": mi.fordblks / MIB,
                    "malloc_arena_mib": mi.arena / MIB, "malloc_mmap_mib": mi.hblkhd / MIB,
                    "malloc_arenas": len(arenas), "arena_kib": [[a >> 10, f >> 10] for a, f in arenas],
                    "thread_names": sorted(t.name for t in threading.enumerate())})
    if traced:
        import tracemalloc

        out["traced_mib"] = tracemalloc.get_traced_memory()[0] / MIB
    return out


class _BareEtcd:
    """What a standby master does with etcd, alone: one thread keeping a lease alive and reading
    the leader key every 0.5 s (`LeaderElection`'s loop without the election)."""

    def __init__(self, meta: str):
        from kvpool.cluster import EtcdClient

        self.etcd = EtcdClient(meta)
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="bare-etcd", daemon=True)
        self.address = "-"

    def _loop(self) -> None:
        lease = self.etcd.grant(3)
        while not self.stop_event.wait(0.5):
            self.etcd.keepalive(lease)
            self.etcd.get_with_lease("/kvpool/leader")

    def start(self) -> "_BareEtcd":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(5)
        self.etcd.close()


def child(meta: str, samples: str, period: float, traced: bool, admin: bool, trim: bool = False,
          bare: bool = False, read_bytes: int = 0) -> None:
    """Run a cluster master here (`bare`: only its etcd traffic) and sample this process until SIGTERM.
    `trim`: call malloc_trim(0) after each sample and record the RSS after it too."""
    if traced:
        import tracemalloc

        tracemalloc.start(10)
    if read_bytes:  # the size of httpcore's socket reads (64 KiB by default)
        from httpcore._sync.http11 import HTTP11Connection

        HTTP11Connection.READ_NUM_BYTES = read_bytes
    from kvpool.config import load_settings
    from kvpool.master.server import MasterServer

    settings = load_settings(port=0, meta=meta, admin_port=0)
    server = _BareEtcd(meta).start() if bare else MasterServer(settings).start()
    handle = None
    if admin:
        from kvpool.admin.app import create_app
        from kvpool.admin.server import serve_in_thread
        from kvpool.tools.launch.processes import free_port

        handle = serve_in_thread(create_app(server.service.admin, settings), "127.0.0.1", free_port())
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    libc = _libc()
    first = None
    if traced:
        import tracemalloc

        first = tracemalloc.take_snapshot()
    print(f"kvpool master at {server.address}", flush=True)
    with open(samples, "a") as out:
        while True:
            row = sample(libc, traced)
            if trim and libc is not None:
                libc.malloc_trim(0)
                row["trimmed_anon_mib"] = sample(None, False)["anon_mib"]
            out.write(json.dumps(row) + "\n")
            out.flush()
            if done.wait(period):
                break
    if traced:
        import tracemalloc

        top = tracemalloc.take_snapshot().compare_to(first, "lineno")[:15]
        with open(samples + ".tracemalloc.txt", "w") as f:
            f.write("\n".join(str(s) for s in top) + "\n")
    if handle is not None:
        handle.stop()
    server.stop()


def slope_mib_h(ts: list[float], ys: list[float]) -> float:
    n = len(ts)
    if n < 2:
        return 0.0
    mt, my = sum(ts) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    return 0.0 if var == 0 else 3600 * sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var


def report(paths: list[str]) -> None:
    keys = ("rss_mib", "anon_mib", "trimmed_anon_mib", "heap_brk_mib", "anon_maps_mib", "malloc_arena_mib",
            "malloc_used_mib", "malloc_free_mib", "malloc_mmap_mib", "traced_mib")
    for path in paths:
        rows = [json.loads(line) for line in open(path) if line.strip()]
        if len(rows) < 4:
            print(f"{path}: {len(rows)} samples, too few")
            continue
        t0 = rows[0]["t"]
        ts = [r["t"] - t0 for r in rows]
        half = len(rows) // 2
        print(f"{path}: {len(rows)} samples over {ts[-1] / 60:.1f} min")
        for key in keys:
            if key not in rows[0]:
                continue
            ys = [r[key] for r in rows]
            print(f"  {key:16s} {ys[0]:8.2f} -> {ys[-1]:8.2f} MiB   slope {slope_mib_h(ts, ys):+6.2f} MiB/h   "
                  f"second half {slope_mib_h(ts[half:], ys[half:]):+6.2f} MiB/h")
        for key in ("threads", "anon_maps", "malloc_arenas", "py_blocks", "gc_objects", "arena_kib"):
            if key in rows[0]:
                print(f"  {key:16s} {rows[0][key]} -> {rows[-1][key]}")


def run(args: argparse.Namespace) -> None:
    from kvpool.tools.chaos.procs import Etcd

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"idle-heap-{args.variant}-"))
    samples = str(out / f"{args.variant}.jsonl")
    if os.path.exists(samples):
        os.unlink(samples)
    env = dict(os.environ)
    for item in args.env:
        k, _, v = item.partition("=")
        env[k] = v
    etcd = Etcd(work).start()
    meta = f"etcd://{etcd.address}"
    procs: list[subprocess.Popen] = []
    try:
        cmd = [sys.executable, "-m", "kvpool.tools.scripts.idle_heap", "--child", "--meta", meta,
               "--samples", samples, "--period", str(args.period)]
        if args.tracemalloc:
            cmd.append("--tracemalloc")
        for flag in ("admin", "trim", "bare"):
            if getattr(args, flag):
                cmd.append(f"--{flag}")
        if args.read_bytes:
            cmd += ["--read-bytes", str(args.read_bytes)]
        master = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=open(work / "master.log", "w"),
                                  text=True)
        procs.append(master)
        if not master.stdout.readline().startswith("kvpool master at"):
            raise RuntimeError(f"the master did not start; see {work}/master.log")
        node = None if args.no_node else subprocess.Popen(
            [sys.executable, "-c", "from kvpool.cli import main; main()", "--log-level", "WARNING", "node",
             "--port", "0", "--meta", meta, "--node-id", "n0", "--dram-capacity", "16MiB", "--admin-port", "0"],
            env=env, stdout=subprocess.DEVNULL, stderr=open(work / "node.log", "w"))
        if node is not None:
            procs.append(node)
        print(f"{args.variant}: master pid {master.pid}, samples in {samples}", flush=True)
        deadline = time.monotonic() + 60 * args.minutes
        while time.monotonic() < deadline and all(p.poll() is None for p in procs):
            time.sleep(5)
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
        etcd.stop()
        shutil.rmtree(work, ignore_errors=True)
    report([samples])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=60)
    p.add_argument("--period", type=float, default=30, help="seconds between samples")
    p.add_argument("--out", default="idle-heap")
    p.add_argument("--variant", default="plain", help="name of the samples file")
    p.add_argument("--env", action="append", default=[], help="K=V for the master and node (repeatable)")
    p.add_argument("--tracemalloc", action="store_true")
    p.add_argument("--admin", action="store_true", help="also serve the REST admin API in the master")
    p.add_argument("--trim", action="store_true", help="malloc_trim(0) after each sample")
    p.add_argument("--bare", action="store_true", help="no master: only a standby's etcd traffic, in a thread")
    p.add_argument("--no-node", action="store_true", help="start no node")
    p.add_argument("--read-bytes", type=int, default=0, help="httpcore's socket read size in the master")
    p.add_argument("--report", nargs="+", metavar="JSONL")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--meta", help=argparse.SUPPRESS)
    p.add_argument("--samples", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.report:
        report(args.report)
    elif args.child:
        child(args.meta, args.samples, args.period, args.tracemalloc, args.admin, args.trim, args.bare,
              args.read_bytes)
    else:
        run(args)


if __name__ == "__main__":
    main()
