"""`kvpool bench pool --workload many-clients`: aggregate get throughput and latency of many client
processes at once, ours against Redis and Mooncake Store with the same client counts, one run.

Each client is its own process (a Python client's own GIL must not be what limits the figure),
started once per client count and kept for every system: it opens one connection per system
(kvpool SDK over TCP and same-host, redis-py over TCP, Mooncake's client over TCP) and, when told,
runs gets of `size` bytes into a preallocated buffer from a common start time for `duration`
seconds, recording each get's latency. Every get is checked (the first 8 bytes of each value
are its index). Systems alternate per repetition (A B C, B C A, ...) so all see the same noise.
Figures: aggregate ops/s (the sum over clients of gets completed in the window, divided by it),
latency p50/p99 over every get of every client; ratios against each baseline's figure at the
same client count. On this 2-core machine clients and servers share the cores: the question the
figure answers is whether a server's aggregate falls as clients are added, not how far it scales.
With key `readers`, `ours_tcp+readers` is a second pool whose node has its read workers
(`kvpool.node.readers`; their CPU counts as the server's), and `ours_tcp`'s pool has none.
Keys `server_cpus` / `client_cpus` (CPU lists, `0-3,8`) pin every server (ours, Redis, Mooncake)
and every client process to CPUs of their own: on a machine with the cores for it, that asks how
a server scales when clients do not take its cores (on 2 cores they must share).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
from typing import Any, Callable, Collection

import numpy as np

from reference_worker.cpus import format_list
from kvpool.tools.bench.pool_process import PoolProcess, close_all, cpu_clock
from kvpool.tools.launch.processes import child_pids, pin_process
from kvpool.tools.bench.report import Report, progress

log = logging.getLogger(__name__)

KEYS = 32  # distinct values per size and system
READERS = "ours_tcp+readers"


def _key(size: int, i: int) -> str:
    return f"clients/{size}/{i}"


def _value(size: int, i: int) -> np.ndarray:
    value = np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)
    value[:8] = np.frombuffer(int(i).to_bytes(8, "little"), dtype=np.uint8)
    return value


class _Conn:
    """One system's client inside a client process."""

    def __init__(self, name: str, spec: dict[str, Any], sizes: list[int]):
        self.name = name
        self.outs = {s: np.empty(s, dtype=np.uint8) for s in sizes}
        if name.startswith("ours"):
            import kvpool

            self.client = kvpool.connect(spec["address"], use_shm=name == "ours_shm", transports=("tcp",))
            self.get_into = self.client.get_into
        elif name == "redis":
            import redis

            self.client = redis.Redis(host="127.0.0.1", port=spec["port"], socket_timeout=30)

            def get_into(key: str, out: np.ndarray) -> int:
                data = self.client.get(key)
                memoryview(out)[:len(data)] = data
                return len(data)

            self.get_into = get_into
        elif name == "mooncake":
            os.environ.update(spec["env"])
            from mooncake.store import MooncakeDistributedStore

            self.client = MooncakeDistributedStore()
            rc = self.client.setup("127.0.0.1", spec["metadata_url"], 0, 16 << 20, "tcp", "", spec["master"])
            if rc != 0:
                raise RuntimeError(f"Mooncake client setup failed with code {rc}")
            for out in self.outs.values():
                if self.client.register_buffer(out.ctypes.data, out.nbytes) != 0:
                    raise RuntimeError("Mooncake register_buffer failed")
            store = self.client

            def get_into(key: str, out: np.ndarray) -> int:
                n = store.get_into(key, out.ctypes.data, out.nbytes)
                if n < 0:
                    raise RuntimeError(f"Mooncake get_into({key!r}) failed with code {n}")
                return n

            self.get_into = get_into
        else:
            raise ValueError(name)

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:
            pass


def _client_main(conn: Any, index: int, specs: dict[str, dict], sizes: list[int], cpus: list[int] | None) -> None:
    """A client process: set up on request, run timed get loops, report counts and latencies."""
    logging.basicConfig(level=logging.WARNING)
    if cpus:
        os.sched_setaffinity(0, cpus)  # before any client library starts a thread: they inherit it
    systems: dict[str, _Conn] = {}
    try:
        while True:
            cmd = conn.recv()
            if cmd[0] == "quit":
                break
            _, name, size, start_at, duration = cmd
            try:
                system = systems.get(name) or systems.setdefault(name, _Conn(name, specs[name], sizes))
                out = system.outs[size]
                keys = [_key(size, (index + i) % KEYS) for i in range(KEYS)]
                lat = np.empty(1 << 20, dtype=np.float32)
                n = 0
                while time.time() < start_at:
                    time.sleep(0.001)
                clock = time.perf_counter
                end = clock() + duration
                while True:
                    t0 = clock()
                    if t0 >= end:
                        break
                    got = system.get_into(keys[n % KEYS], out)
                    lat[n % lat.size] = clock() - t0
                    if got != size or int.from_bytes(out[:8].tobytes(), "little") != (index + n) % KEYS:
                        raise RuntimeError(f"{name}: get {n} of client {index} returned wrong bytes")
                    n += 1
                conn.send(("ok", n, lat[:min(n, lat.size)]))
            except Exception as exc:  # reported, not raised: the parent decides
                conn.send(("error", f"{type(exc).__name__}: {exc}", None))
    finally:
        for system in systems.values():
            system.close()


def run(report: Report, specs: dict[str, dict], client_counts: list[int], sizes: list[int], reps: int,
        duration: float, client_cpus: list[int] | None = None) -> None:
    """Every (client count, size) x system, `reps` alternating turns each; rows into `report`.
    A system's spec may name its server processes (`pids`): the CPU they use over a turn gives each
    row the servers' CPU per get and the cores they had, which separates a server that costs more
    per get with more clients from one that gets less of a machine the clients share."""
    server_cpu = {name: [cpu_clock(pid) for pid in spec["pids"]] for name, spec in specs.items() if "pids" in spec}

    def cpu(name: str) -> float:
        return sum(clock() for clock in server_cpu.get(name, ()))

    ctx = mp.get_context("spawn")
    names = list(specs)
    bar, advance = progress(len(client_counts) * len(sizes) * reps * len(names), "pool, many clients")
    with bar:
        for count in client_counts:
            procs, pipes = [], []
            try:
                for i in range(count):
                    parent, child = ctx.Pipe()
                    p = ctx.Process(target=_client_main, args=(child, i, specs, sizes, client_cpus), daemon=True)
                    p.start()
                    procs.append(p)
                    pipes.append(parent)
                for size in sizes:
                    figures: dict[str, list[tuple[float, np.ndarray]]] = {n: [] for n in names}
                    for rep in range(reps):
                        order = names[rep % len(names):] + names[:rep % len(names)]
                        for name in order:
                            start_at = time.time() + (5.0 if rep == 0 else 0.5) + 0.02 * count
                            for pipe in pipes:
                                pipe.send(("run", name, size, start_at, duration))
                            cpu_before = cpu(name)  # the clients start together at start_at; idle servers add ~0
                            answers = [pipe.recv() for pipe in pipes]
                            cpu_used = cpu(name) - cpu_before
                            bad = [a[1] for a in answers if a[0] != "ok"]
                            if bad:
                                raise RuntimeError(f"{name} with {count} clients: {bad[0]}")
                            total = sum(a[1] for a in answers)
                            figures[name].append((total / duration, np.concatenate([a[2] for a in answers]),
                                                  cpu_used / max(total, 1) * 1e6, cpu_used / duration))
                            advance()
                    _add(report, count, size, figures, set(server_cpu))
            finally:
                for pipe in pipes:
                    try:
                        pipe.send(("quit",))
                    except OSError:
                        pass
                for p in procs:
                    p.join(10)
                    if p.is_alive():
                        p.kill()


def _add(report: Report, count: int, size: int, figures: dict[str, list[tuple[float, np.ndarray, float, float]]],
         measured_cpu: Collection[str] = ()) -> None:
    def lat(name: str, q: float) -> float:
        return round(float(np.percentile(np.concatenate([f[1] for f in figures[name]]), q)) * 1e6, 1)

    def server(name: str, prefix: str, extra: dict[str, Any]) -> None:
        """The median over turns of the servers' CPU per get (µs) and the cores they used."""
        if name in measured_cpu:
            extra[f"{prefix}server_cpu_us_per_get"] = round(float(np.median([f[2] for f in figures[name]])), 1)
            extra[f"{prefix}server_cores"] = round(float(np.median([f[3] for f in figures[name]])), 2)

    ours = [n for n in figures if n.startswith("ours")]
    peers = [n for n in figures if not n.startswith("ours")]
    for name in ours:
        values = [f[0] for f in figures[name]]
        extra = {"clients": count, "p50_us": lat(name, 50), "p99_us": lat(name, 99)}
        server(name, "", extra)
        for peer in peers:
            extra[f"{peer}_p50_us"], extra[f"{peer}_p99_us"] = lat(peer, 50), lat(peer, 99)
            server(peer, f"{peer}_", extra)
        case = f"get_{name.removeprefix('ours_')}_clients_{count}"
        if not peers:
            report.add(case, values, "ops/s", size=size, extra=extra)
        for peer in peers:
            report.add(case, values, "ops/s", size=size, baseline=peer,
                       baseline_values=[f[0] for f in figures[peer]], extra=extra)


def many(as_json: bool, sizes: list[int], reps: int, wanted: set[str], counts: list[int], duration: float,
         readers: bool = False, server_cpus: list[int] | None = None, client_cpus: list[int] | None = None) -> None:
    """Key `clients`: every system serves the same keys to 1..N client processes."""
    from kvpool.tools.bench.pool_peers import MooncakePeer, RedisPeer, _mooncake_env, mooncake_available

    report = Report("pool")
    shared = "shared by clients and servers" if not (server_cpus or client_cpus) else "split (below)"
    report.notes.append(f"many clients: {counts} client processes, {duration:g} s per turn, {reps} turns per "
                        f"system, gets of one value at a time; {os.cpu_count()} CPUs {shared}")
    closers: list[Callable[[], None]] = []
    try:
        load: list[Callable[[str, np.ndarray], None]] = []
        # The node alone when `readers` compares it with one that has workers; else the default node.
        ours = _pool(closers, load, report, "ours_tcp", 0 if readers else -1)
        specs: dict[str, dict] = {"ours_tcp": ours, "ours_shm": ours}  # pids: the server processes
        if readers:
            specs[READERS] = _pool(closers, load, report, READERS, -1)
        if "redis" in wanted:
            try:
                redis = RedisPeer()
                closers.append(redis.close)
                specs["redis"] = {"port": redis.port, "pids": [redis.proc.pid]}
                load.append(redis.put)
            except RuntimeError as exc:
                report.notes.append(f"Redis skipped: {exc}")
        if "mooncake" in wanted:
            why = mooncake_available()
            if why is None:
                mc = MooncakePeer(segment_bytes=512 << 20, buffer_bytes=64 << 20)
                closers.append(mc.close)
                specs["mooncake"] = {"metadata_url": mc.metadata_url, "master": mc.master_address,
                                     "pids": [mc.master.pid, mc.owner.pid],  # metadata, data
                                     "env": {k: v for k, v in _mooncake_env().items() if k.startswith(("MC_", "GLOG_"))}}
                load.append(lambda key, value, mc=mc: _mooncake_put(mc, key, value))
            else:
                report.notes.append(f"Mooncake skipped: {why}")
        for size, i in ((size, i) for size in sizes for i in range(KEYS)):  # every system, every key
            value = _value(size, i)
            for put in load:
                put(_key(size, i), value)
        if server_cpus:
            _pin_servers(report, specs, server_cpus)
        if client_cpus:
            report.notes.append(f"client processes pinned to CPUs {format_list(client_cpus)}")
        run(report, specs, counts, sizes, reps, duration, client_cpus)
    finally:
        close_all(closers)
    report.emit(as_json)


def _pool(closers: list[Callable[[], None]], load: list[Callable[[str, np.ndarray], None]], report: Report,
          name: str, read_workers: int) -> dict[str, Any]:
    """A pool whose node has `read_workers` (-1: the default count): its spec once the workers run
    (they start with the read port's first get), so their CPU counts as the server's."""
    from kvpool.node.readers import worker_count
    from kvpool.tools.bench.pool import Ours

    server = PoolProcess(dram_capacity=1 << 30, settings={"KVPOOL_READ_WORKERS": str(read_workers)})
    closers.append(server.close)
    loader = Ours(server.address, False, f"loader {name}")
    closers.append(loader.close)
    load.append(loader.put)
    want = worker_count(read_workers)
    if want:
        probe = np.zeros(8, dtype=np.uint8)
        loader.put("readers/probe", probe)
        loader.get_into("readers/probe", probe)
    deadline = time.monotonic() + 60
    while len(workers := child_pids(server.proc.pid)) < want and time.monotonic() < deadline:
        time.sleep(0.1)
    report.notes.append(f"{name}: {len(workers)} read worker(s) beside the node")
    return {"address": server.address, "pids": [server.proc.pid, *workers]}


def _pin_servers(report: Report, specs: dict[str, dict], cpus: list[int]) -> None:
    """Every server process (and the processes it started, and all their threads) on `cpus`; the
    note says what the kernel reads back for each."""
    got: dict[str, str] = {}
    for name, spec in specs.items():
        pids = set(spec.get("pids", ()))
        for pid in list(pids):
            pids |= child_pids(pid)
        allowed = {format_list(sorted(pin_process(pid, cpus))) for pid in sorted(pids)}
        got[name.removeprefix("ours_")] = "/".join(sorted(allowed))
    report.notes.append("servers pinned: " + ", ".join(f"{name} on CPUs {cores}" for name, cores in got.items()))


def _mooncake_put(mc: Any, key: str, value: np.ndarray) -> None:
    mc.register(value)
    mc.put(key, value)
