"""`kvpool bench pool`: put/get throughput of the pool through the SDK, against Redis and
Mooncake Store, all measured in the same run.

Setup: the pool runs as `kvpool serve` in a child process; this process is the SDK client,
once with shared memory disabled (every byte crosses loopback TCP), once same-host (`shm`), and
once with the transfer-engine data path over TCP (`tcp-engine`: reserve / one-sided WRITE /
commit, pin / one-sided READ), whose rows are also compared with `ours_tcp` (the node-RPC path).
Redis is a private `redis-server` (redis-py client) over loopback TCP, and another over its unix
socket (`redis_unix`, the same-host baseline for `ours_shm`, whose requests go over the pool's
unix socket and whose reads come from the shm arena); Mooncake Store runs in TCP mode with the
segment in another process (see `pool_peers`). Every system does the same work per repetition
(a short turn: 8 MiB by default, at least 16 ops; 21 turns each): `count` gets (or puts) of
`size` bytes, one at a time, into a preallocated buffer where the API allows it (`get_into`;
redis-py has none). Systems are run in turn (ours tcp, ours shm, redis, mooncake, ours tcp, ...)
after a warm-up so all see the same noise; each figure is a median.

Correctness is checked, not assumed: every key holds distinct bytes, the warm-up reads every key
of every system and compares it, and each timed repetition compares the last value it read.
Goals (issue): TCP get >= 1.3x Mooncake at >= 1 MiB and >= 1x at 64 KiB (single and batched);
shm get >= 3x Mooncake's TCP; ahead of Redis at every size. They are printed as notes.

`--workload auth` (key `auth`) also runs a second `kvpool serve` with a keyring (issue 13) and a tenant
client of it over TCP and same-host (`ours_tcp+auth`, `ours_shm+auth`) and, unless `engine=false`, on
the transfer-engine path (`ours_tcp-engine+auth`: a grant per op, checked and counted per frame, issue
27), each compared with its counterpart without authentication in the same run (goal: under 5% cost),
and a third pool without a keyring (`ours_tcp+control`, compared with `ours_tcp` alike): what two server
processes differ by when neither authenticates, the measurement's own floor. These pairs are measured
fairly: each twin runs right next to its counterpart, in the order A B, then B A on the next turn (so
neither always follows the other, or a warm or a busy moment), and the ratio is the median of the
per-turn ratios, not the ratio of two medians. Every `ours` row also carries the CPU time per operation
of the client thread and of the whole server process (`client_cpu_us`, `server_cpu_us`, from the process
CPU clock): on a loaded machine CPU per op moves less than wall time. What authentication adds per
operation: a role check and the tenant's key scoping on each request; the HMAC handshake runs once per
connection, and no MAC is computed over bulk bytes on this path. A pool "without a keyring" runs the
default mode: its user's own keyring (`kvpool.security.local`: the same once-per-connection handshake,
no roles, scoping or grants); `KVPOOL_LOCAL_AUTH=off` on the bench measures the pools and clients with
no handshake at all.
"""

from __future__ import annotations

import logging
import time
from typing import Annotated, Any, Callable, Literal

import click
import numpy as np
from pydantic import BeforeValidator, Field, PositiveInt

from kvpool.tools.bench.pool_peers import MooncakePeer, RedisPeer, mooncake_available
from kvpool.tools.bench.pool_process import PoolProcess, auth_pool, close_all
from kvpool.tools.bench.report import Report, gbps, progress
from kvpool.tools.workload_file import Size, WorkloadFile, list_of, takes_workload

log = logging.getLogger(__name__)

GOALS = {  # (case, baseline, min size, max size) -> minimum ratio
    ("get_tcp", "mooncake_tcp", 1 << 20, None): 1.3,
    ("get_tcp", "mooncake_tcp", 0, (1 << 20) - 1): 1.0,
    ("get_batch_tcp", "mooncake_tcp", 0, (1 << 20) - 1): 1.0,
    ("get_shm", "mooncake_tcp", 0, None): 3.0,
    ("get_tcp", "redis", 0, None): 1.0,
    ("get_shm", "redis", 0, None): 1.0,
    ("get_batch_tcp", "redis", 0, None): 1.0,
    ("put_tcp", "redis", 0, None): 1.0,
    # ours, not the issue's: same-host against Redis also on its fastest local path
    ("put_shm", "redis", 0, None): 1.0,
    ("put_shm", "redis_unix", 0, None): 1.0,
    ("get_shm", "redis_unix", 0, None): 1.0,
}
SAME_HOST_PEERS = ("redis_unix",)  # compared with ours_shm only


ENGINE = "ours_tcp-engine"
AUTH = "+auth"  # suffix of the systems whose pool has a keyring (key auth)
CONTROL = "+control"  # suffix of the system of a second pool without one (key auth): the A/A control
TWINS = (AUTH, CONTROL)  # each compared with the system its name ends in, per turn (`_paired`)
# clients of ours_tcp's pool (or of ours_tcp+auth's): nothing of their own to load or clean
SHARES_POOL = ("ours_shm", ENGINE, "ours_shm" + AUTH, ENGINE + AUTH)


class Ours:
    """The SDK client as a bench system; `use_shm=False` forces every request over TCP;
    `data_path="engine"` moves the bytes through the transfer engine (over TCP)."""

    def __init__(self, address: str, use_shm: bool, name: str, data_path: str = "rpc", credential: Any = None,
                 server: PoolProcess | None = None):
        import kvpool

        self.name = name
        self.server = server
        self.server_cpu = server.cpu_seconds if server is not None else None
        self.cpu = (0.0, 0.0)  # the last timed turn's CPU seconds: this thread's, the server's
        self.client = kvpool.connect(address, use_shm=use_shm, data_path=data_path, transports=("tcp",),
                                     credential=credential)

    def put(self, key: str, value: np.ndarray) -> None:
        self.client.put_from(key, value)

    def get_into(self, key: str, out: np.ndarray) -> int:
        return self.client.get_into(key, out)

    def get_batch_into(self, keys: list[str], outs: list[np.ndarray]) -> None:
        self.client.get_batch_into(keys, outs)

    def remove(self, keys: list[str]) -> None:
        self.client.remove_batch(keys)

    def close(self) -> None:
        self.client.close()


class Workload:
    """The keys and bytes of one size: `count` distinct values (first 8 bytes = index)."""

    def __init__(self, size: int, count: int, batch: int, seed: int = 7):
        self.size, self.count, self.batch = size, count, batch
        self.base = np.random.default_rng(seed + size).integers(0, 256, size, dtype=np.uint8)
        self.value = self.base.copy()
        self.out = np.zeros(size, np.uint8)
        self.outs = [np.zeros(size, np.uint8) for _ in range(batch)]
        self.get_keys = [f"bench/get/{size}/{i}" for i in range(count)]
        self._put_round = 0

    def fill(self, i: int) -> np.ndarray:
        self.value[:8] = np.frombuffer(int(i).to_bytes(8, "little"), np.uint8)
        return self.value

    def check(self, i: int, out: np.ndarray, system: str) -> None:
        if int.from_bytes(out[:8].tobytes(), "little") != i or not np.array_equal(out[8:], self.base[8:]):
            raise RuntimeError(f"{system}: wrong bytes for value {i} of size {self.size}")

    def next_put_keys(self) -> list[str]:
        self._put_round += 1
        return [f"bench/put/{self.size}/{self._put_round}/{i}" for i in range(self.count)]


def _clocks(system: Any) -> tuple[float, float]:
    """(this thread's CPU seconds, the system's server's), 0 where not known."""
    server = getattr(system, "server_cpu", None)
    return time.thread_time(), server() if server is not None else 0.0


def _took(system: Any, before: tuple[float, float]) -> None:
    """Keep the CPU a timed turn of `system` took (systems that have `cpu`: ours)."""
    if hasattr(system, "cpu"):
        after = _clocks(system)
        system.cpu = (after[0] - before[0], after[1] - before[1])


def _get(system: Any, w: Workload) -> float:
    cpu = _clocks(system)
    start = time.perf_counter()
    for key in w.get_keys:
        system.get_into(key, w.out)
    seconds = time.perf_counter() - start
    _took(system, cpu)
    w.check(w.count - 1, w.out, system.name)
    return gbps(w.size * w.count, seconds)


def _get_batch(system: Any, w: Workload) -> float:
    cpu = _clocks(system)
    start = time.perf_counter()
    for j in range(0, w.count, w.batch):
        keys = w.get_keys[j:j + w.batch]
        system.get_batch_into(keys, w.outs[:len(keys)])
    seconds = time.perf_counter() - start
    _took(system, cpu)
    last = (w.count - 1) // w.batch * w.batch
    w.check(last, w.outs[0], system.name)
    return gbps(w.size * w.count, seconds)


def _put(system: Any, w: Workload) -> float:
    keys = w.next_put_keys()
    cpu = _clocks(system)
    start = time.perf_counter()
    for i, key in enumerate(keys):
        system.put(key, w.fill(i))
    seconds = time.perf_counter() - start
    _took(system, cpu)
    system.remove(keys)  # untimed: keep every system's memory bounded
    return gbps(w.size * w.count, seconds)


def _prepare(systems: list[Any], w: Workload) -> None:
    """Load the get keys into every system and read each back once (correctness, warm caches)."""
    stores = {id(s): s for s in systems if s.name not in SHARES_POOL}
    for system in stores.values():
        for i, key in enumerate(w.get_keys):
            system.put(key, w.fill(i))
    for system in systems:
        for i, key in enumerate(w.get_keys):
            w.out[:8] = 0
            system.get_into(key, w.out)
            w.check(i, w.out, system.name)


def _settle(servers: Any) -> None:
    """Let the pools and this process's own background work (the shm clients map the pools'
    arenas, `kvpool.client.nodes`) finish before anything is timed."""
    import threading

    for t in threading.enumerate():
        if t.name == "kvpool-populate":
            t.join(120)
    for server in servers:
        server.settle()


CpuList = Annotated[str, BeforeValidator(str)]  # "0-3,8"; `--set server_cpus=0` arrives as the number 0


class PoolWorkload(WorkloadFile):
    """`kvpool bench pool`'s keys; the defaults are the single-client table of BENCHMARKS.md."""

    sizes: list_of(Size) = Field(["64KiB", "1MiB", "8MiB"], description="Value sizes.")
    bytes_per_rep: Size = Field("8MiB", description="Bytes each system moves per repetition.")
    min_ops: PositiveInt = Field(16, description="At least this many operations per repetition.")
    # Many short turns rather than a few long ones: on a shared machine a burst of load then lands
    # on every system alike instead of on whichever one held the CPU at that moment.
    reps: int = Field(21, ge=1, le=200, description="Repetitions (turns) of every system.")
    batch: int = Field(16, ge=1, le=1024, description="Keys per batch call.")
    peers: list_of(Literal["redis", "mooncake"]) = Field(["redis", "mooncake"], description="Baselines to run.")
    put: bool = Field(True, description="Measure puts too (false: gets only).")
    engine: bool = Field(True, description="Also the transfer-engine data path (tcp-engine).")
    clients: list_of(Annotated[int, Field(ge=1, le=256)]) = Field(
        [], description="Many-clients mode: aggregate gets of this many client processes at once (e.g. [1, 4, 16, "
        "64]), ours (TCP and same-host) vs the peers; sizes, reps and peers apply.")
    duration: float = Field(2.0, ge=0.2, le=60, description="Many-clients mode: seconds each turn runs.")
    readers: bool = Field(False, description="Many-clients mode: also ours_tcp+readers, a pool with its node's read "
                          "workers ([node] read_workers), ours_tcp's pool then without.")
    server_cpus: CpuList = Field("", description="Many-clients mode: pin every server (ours, Redis, Mooncake) to these "
                             "CPUs, e.g. 0-3 ('' leaves them to the scheduler).")
    client_cpus: CpuList = Field("", description="Many-clients mode: pin the client processes to these CPUs, e.g. 4-15.")
    auth: bool = Field(False, description="Also run a pool with a keyring and a tenant client (TCP and shm), "
                       "compared with the pool without (authentication's cost).")
    netns: bool = Field(False, description="Across a shaped link between two network namespaces (root): ours vs a "
                        "raw socket store over the same link, and the link's rate (kvpool.tools.bench.pool_netns).")
    rtt_ms: float = Field(1.0, ge=0, le=1000, description="netns: the link's round trip (0: no delay line).")
    link_rate: str = Field("10gbit", description="netns: the link's rate (tc syntax; '' for none).")
    loss_pct: float = Field(0.0, ge=0, le=100, description="netns: percent of packets lost each way.")


@takes_workload("bench pool", PoolWorkload)
@click.command("pool")
@click.option("--sizes", help="Value sizes, comma-separated (key sizes).")
@click.option("--reps", type=click.IntRange(1, 200), help="Repetitions (key reps).")
@click.option("--peers", help="Baselines to run: redis, mooncake, comma-separated, '' for none (key peers).")
@click.option("--json", "as_json", is_flag=True, help="End the output with one JSON line.")
def pool(workload: PoolWorkload, as_json: bool) -> None:
    """SDK put/get GB/s and ops/s (TCP forced and same-host shm) vs Redis and Mooncake Store (TCP);
    with the many-clients preset (key clients), aggregate gets of many client processes at once."""
    from kvpool.config import parse_size

    w = workload
    reps, batch, no_put, no_engine, auth = w.reps, w.batch, not w.put, not w.engine, w.auth
    size_list = [parse_size(s) for s in w.sizes]
    per_rep = parse_size(w.bytes_per_rep)
    wanted = set(w.peers)
    if w.clients:
        from kvpool.tools.bench.pool_clients import many

        from reference_worker.cpus import parse as cpu_list

        return many(as_json, size_list, reps, wanted, list(w.clients), w.duration, w.readers,
                    cpu_list(w.server_cpus) if w.server_cpus else None, cpu_list(w.client_cpus) if w.client_cpus else None)
    min_ops = w.min_ops
    if w.netns:
        from kvpool.tools.bench.pool_netns import run_across

        return run_across(as_json, size_list, per_rep, min_ops, reps, batch, no_put, no_engine, w.rtt_ms,
                          w.link_rate or None, w.loss_pct)
    report = Report("pool")
    workloads = [Workload(s, max(min_ops, per_rep // s), batch) for s in size_list]
    working_set = sum(w.size * w.count for w in workloads)
    closers: list[Callable[[], None]] = []
    systems: list[Any] = []
    try:
        server = PoolProcess(dram_capacity=max(1 << 30, 4 * working_set))
        closers.append(server.close)
        ours = [(False, "ours_tcp", "rpc"), (True, "ours_shm", "rpc")]
        if not no_engine:
            ours.append((False, ENGINE, "engine"))
        for use_shm, name, data_path in ours:
            systems.append(Ours(server.address, use_shm, name, data_path, server=server))
            closers.append(systems[-1].close)
        if auth:
            secured, credential, cleanup = auth_pool(max(1 << 30, 4 * working_set))
            closers.append(cleanup)
            secured_paths = [(False, "ours_tcp", "rpc"), (True, "ours_shm", "rpc")]
            if not no_engine:  # the engine path with grants (issue 27: each frame counted under its grant)
                secured_paths.append((False, ENGINE, "engine"))
            for use_shm, name, data_path in secured_paths:
                systems.append(Ours(secured.address, use_shm, name + AUTH, data_path, credential, server=secured))
                closers.append(systems[-1].close)
            control = PoolProcess(dram_capacity=max(1 << 30, 4 * working_set))  # started as `secured` was
            closers.append(control.close)
            systems.append(Ours(control.address, False, "ours_tcp" + CONTROL, "rpc", server=control))
            closers.append(systems[-1].close)
        if "redis" in wanted:
            try:
                for unix in (False, True):
                    systems.append(RedisPeer(unix=unix))
                    closers.append(systems[-1].close)
            except RuntimeError as exc:
                report.notes.append(f"Redis skipped: {exc}")
        if "mooncake" in wanted:
            why = mooncake_available()
            if why is None:
                try:
                    mc = MooncakePeer(segment_bytes=max(512 << 20, 3 * working_set),
                                      buffer_bytes=max(64 << 20, 2 * batch * max(size_list)))
                    closers.append(mc.close)
                    mc.name = "mooncake_tcp"
                    for w in workloads:
                        for array in (w.value, w.out, *w.outs):
                            mc.register(array)
                    systems.append(mc)
                except RuntimeError as exc:
                    report.notes.append(f"Mooncake skipped: {exc}")
            else:
                report.notes.append(f"Mooncake skipped: {why}")
        _run(report, systems, workloads, reps, no_put)
    finally:
        close_all(closers)
    _check_goals(report)
    report.emit(as_json)


def _run(report: Report, systems: list[Any], workloads: list[Workload], reps: int, no_put: bool) -> None:
    ours = [s for s in systems if s.name.startswith("ours")]
    peers = [s for s in systems if not s.name.startswith("ours")]
    ops: list[tuple[str, Callable[[Any, Workload], float], list[Any]]] = [("get", _get, systems)]
    ops.append(("get_batch", _get_batch, systems))
    max_batch_bytes = 16 << 20  # a batch call of 16 x 8 MiB says nothing a single get does not
    if not no_put:  # ours_shm puts over the pool's unix socket
        ops.append(("put", _put, systems))
    total = sum(len(members) * (reps + 1) for op, _, members in ops for w in workloads
                if op != "get_batch" or w.size * w.batch <= max_batch_bytes)
    bar, advance = progress(total, "bench pool")
    servers = {id(s.server): s.server for s in ours if getattr(s, "server", None) is not None}
    with bar:
        for w in workloads:
            _prepare(systems, w)
            _settle(servers.values())
            for op, fn, members in ops:
                if op == "get_batch" and w.size * w.batch > max_batch_bytes:
                    continue
                figures: dict[str, list[float]] = {s.name: [] for s in members}
                cpu: dict[str, list[tuple[float, float]]] = {s.name: [] for s in members if hasattr(s, "cpu")}
                for rep in range(reps + 1):  # round 0 is the warm-up
                    for system in _order(members, rep):
                        value = fn(system, w)
                        if rep:
                            figures[system.name].append(value)
                            if system.name in cpu:
                                cpu[system.name].append(system.cpu)
                        advance()
                _add_rows(report, op, w, figures, [s.name for s in ours], [s.name for s in peers], cpu)
            for system in {id(s): s for s in systems if s.name not in SHARES_POOL}.values():
                system.remove(w.get_keys)


def _twin_of(name: str) -> str | None:
    """The system a twin (`+auth`, `+control`) is compared with, or None for any other."""
    for suffix in TWINS:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return None


def _order(members: list[Any], rep: int) -> list[Any]:
    """`members` in the order of turn `rep`: each twin right next to its counterpart, after it on
    even turns and before it on odd ones (A B, B A, ...): the pair shares the machine's state
    and neither always runs first."""
    names = {s.name for s in members}
    twins: dict[str, list[Any]] = {}
    for s in members:
        base = _twin_of(s.name)
        if base in names:
            twins.setdefault(base, []).append(s)
    order: list[Any] = []
    for s in members:
        if _twin_of(s.name) in names:
            continue
        group = [s, *twins.get(s.name, ())]
        order.extend(reversed(group) if rep % 2 else group)
    return order


def _per_op_us(turns: list[tuple[float, float]], count: int) -> tuple[float, float]:
    """Median CPU µs per op of the client thread and of the server over `turns`."""
    return (round(float(np.median([c for c, _ in turns])) * 1e6 / count, 1),
            round(float(np.median([s for _, s in turns])) * 1e6 / count, 1))


def _add_rows(report: Report, op: str, w: Workload, figures: dict[str, list[float]], ours: list[str],
              peers: list[str], cpu: dict[str, list[tuple[float, float]]]) -> None:
    for mine in ours:
        if mine not in figures:
            continue
        case = f"{op}_{mine.removeprefix('ours_')}"
        rows = [p for p in peers if p in figures and (mine == "ours_shm" or p not in SAME_HOST_PEERS)] or [None]
        if mine == ENGINE and "ours_tcp" in figures:  # the two data paths, side by side
            rows.insert(0, "ours_tcp")
        twin_of = _twin_of(mine)
        if twin_of is not None:  # authentication's cost (or the control's): against the same path without
            rows = [twin_of] if twin_of in figures else [None]
        for peer in rows:
            ops_s = [v * 1e9 / w.size for v in figures[mine]]
            extra: dict[str, Any] = {"ops_per_s": round(float(np.median(ops_s)), 1), "count": w.count}
            if op == "get_batch":
                extra["batch"] = w.batch
            if cpu.get(mine):
                extra["client_cpu_us"], extra["server_cpu_us"] = _per_op_us(cpu[mine], w.count)
            if peer is not None:
                extra["baseline_ops_per_s"] = round(float(np.median(figures[peer])) * 1e9 / w.size, 1)
            paired = twin_of is not None and peer is not None
            if paired:
                per_turn = [a / b for a, b in zip(figures[mine], figures[peer]) if a > 0 and b > 0]
                extra["per_turn_ratio_spread"] = [round(min(per_turn), 3), round(max(per_turn), 3)]
                if cpu.get(peer):
                    extra["baseline_client_cpu_us"], extra["baseline_server_cpu_us"] = _per_op_us(cpu[peer], w.count)
            result = report.add(case, figures[mine], "GB/s", size=w.size, baseline=peer,
                                baseline_values=figures[peer] if peer else None, extra=extra)
            if paired:  # the median of the per-turn ratios (`_order` ran the pair side by side)
                extra["ratio_of_medians"] = result.ratio
                result.ratio = round(float(np.median(per_turn)), 3)


def _check_goals(report: Report) -> None:
    for r in report.results:
        if _twin_of(r.case) is not None and r.ratio is not None:
            x = r.extra
            cpu = (f"; CPU us/op client {x['baseline_client_cpu_us']} -> {x['client_cpu_us']}, server "
                   f"{x['baseline_server_cpu_us']} -> {x['server_cpu_us']}" if "baseline_client_cpu_us" in x else "")
            if r.case.endswith(AUTH):
                verdict = "met" if r.ratio >= 0.95 else "MISSED"
                report.notes.append(f"auth cost {r.case} at {r.size} B: {r.ratio:.3f}x of no auth, median of per-turn "
                                    f"ratios (goal >= 0.95x) {verdict}{cpu}")
            else:
                report.notes.append(f"control {r.case} at {r.size} B (a second pool, no auth either): {r.ratio:.3f}x"
                                    f"{cpu}")
        for (case, baseline, lo, hi), goal in GOALS.items():
            if r.case != case or r.baseline != baseline or r.ratio is None:
                continue
            if r.size is None or r.size < lo or (hi is not None and r.size > hi):
                continue
            verdict = "met" if r.ratio >= goal else "MISSED"
            report.notes.append(f"goal {case} vs {baseline} at {r.size} B: {r.ratio:.2f}x (goal {goal}x) {verdict}")
