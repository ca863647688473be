"""When a connection may poll instead of sleeping: the adaptive spin policy of the pool's RPC.

Waiting for the next request (server) or for a reply (client), a connection may first poll up
to N times without blocking (about a microsecond each): on loopback the other side often
answers within tens of microseconds, and waking a thread that slept costs more than that. Never
when the other side is in this process (`LocalEndpoints`): there it needs our GIL to answer.
Each connection adapts (`Spin`); a server (`SpinPolicy`, `server_spin` polls) spins only for its
sole active client and tells that client so (FLAG_SPIN), and a client (`rpc_spin` polls) spins
only when told: clients cannot see each other (on 2 cores, 4 clients that all spun got 0.85x the
throughput with a worse p99). Settings: `[rpc]` of `kvpool.config`.

Measured here (2 cores, 64 KiB put/get, kvpool/tools/scripts/spin_load.py): one client 2-3x the ops/s over
TCP and 1.4-1.6x same-host; 4 clients 1.0-1.16x; 16 clients 0.79-1.04x (mean 0.95x), p99 within
noise. Large payloads are received polling for a sole active client: puts of 1 MiB 1.4x and
8 MiB 1.36x the GB/s of sleeping in MSG_WAITALL (none at 256 KiB); client side from 2 MiB,
8 MiB get_into 1.2-1.5x (none at 1 MiB).

Those gains need a CPU each for the client and the server. When other processes want the CPUs
too, a poller (which yields between polls) goes to the back of the run queue while a thread
woken from a blocking recv runs at once, so spinning turns into a loss: on this 2-core machine
at load 6-12 (issue 29) one client's 64 KiB TCP gets ran 2.5-6x slower spinning than not. So
nobody spins while the CPUs are contended (`CpuPressure`: Linux PSI `some avg10` above
`spin_max_cpu_pressure`, 10% by default; without PSI, a 1-minute load average above the CPU
count).
"""

from __future__ import annotations

import os
import time

MIXED_NS = 2_000_000  # two clients' requests this close together: nobody spins for this long
SPIN_WORTH_NS = 100_000  # a blocking wait shorter than this turns spinning back on
STREAM_SPIN_MIN = 256 << 10  # server: payloads from this size are received polling
STREAM_SPIN_MIN_CLIENT = 2 << 20  # client: likewise
STREAM_POLLS = 256  # empty polls in a row before a streaming receive blocks


class Spin:
    """How many non-blocking polls the next wait on one connection may make (0: block at once).

    Spin on while spins find data (`won`); a spin that found nothing (`lost`) turns it off;
    while off, each blocking wait is timed (`waited`) and a short one (under `SPIN_WORTH_NS`)
    turns it back on. So a client sending a burst of requests is spun for from its second
    request, and one that pauses longer than a spin costs at most every other wait's spin."""

    __slots__ = ("cap", "polls")

    def __init__(self, cap: int):
        self.cap = cap
        self.polls = cap

    def won(self) -> None:
        self.polls = self.cap

    def lost(self) -> None:
        self.polls = 0

    def waited(self, ns: int) -> None:
        """A blocking wait (with spinning off) took `ns`."""
        self.polls = self.cap if ns < SPIN_WORTH_NS else 0


PRESSURE_PATH = "/proc/pressure/cpu"
PRESSURE_EVERY_NS = 250_000_000  # how often a server looks again


class CpuPressure:
    """Whether this machine's CPUs have been contended lately: the share of the last 10 s in
    which some runnable task waited for a CPU (Linux PSI, `some avg10`, in %) above `limit`;
    where the kernel has no PSI, the 1-minute load average above the CPU count. Read at most
    every `PRESSURE_EVERY_NS` (a file read, ~10 us); `limit` 100: never contended (no read)."""

    __slots__ = ("limit", "path", "_next", "_busy")

    def __init__(self, limit: float = 10.0, path: str = PRESSURE_PATH):
        self.limit, self.path = limit, path
        self._next = 0
        self._busy = False

    def busy(self, now: int) -> bool:
        """`now`: time.monotonic_ns()."""
        if now >= self._next:
            self._next = now + PRESSURE_EVERY_NS
            self._busy = self.limit < 100 and self.read() > self.limit
        return self._busy

    def read(self) -> float:
        """The CPU pressure now (%): PSI's `some avg10`, else 100 * load / CPUs."""
        try:
            with open(self.path, "rb") as f:
                return float(f.readline().split()[1].partition(b"=")[2])
        except (OSError, IndexError, ValueError):
            return 100.0 * os.getloadavg()[0] / (os.cpu_count() or 1)


class SpinPolicy:
    """One server's view of its connection threads (ids): which are handling a request
    (`busy`), which are spinning for one, and whether clients have been interleaving. A thread
    may spin for its client's next request only while no other is busy or spinning and no two
    clients' requests followed each other within `MIXED_NS`: with several busy clients the
    server has work anyway, and the clients need the CPU a spin would take; and only while the
    machine's CPUs are not contended (`pressure`), for the same reason. A thread is in
    `spinning` only while it polls: one whose polls ran out leaves it before it blocks
    (`Reader.fill`), or an idle connection would stop the server spinning for anyone else.
    `set.add` / `discard` are atomic under the GIL; the rest is advisory (a wrong answer costs a
    spin or a sleep)."""

    def __init__(self, polls: int, pressure: CpuPressure):
        self.polls = polls
        self.pressure = pressure  # contended CPUs: nobody spins
        self.busy: set[int] = set()
        self.spinning: set[int] = set()
        self._last = [0, 0, 0]  # thread of the last request, when it came, until when clients count as mixed

    def connection(self, peer_in_process: bool) -> Spin:
        return Spin(0 if peer_in_process else self.polls)

    def alone(self, me: int) -> bool:
        """No connection thread but `me` is handling a request or spinning."""
        return not self.busy and self.spinning.issubset((me,))

    def request_from(self, me: int) -> int:
        """Note a request arriving on `me`'s connection; returns the time (ns)."""
        now = time.monotonic_ns()
        last = self._last
        if last[0] != me and now - last[1] < MIXED_NS:
            last[2] = now + MIXED_NS
        last[0], last[1] = me, now
        return now

    def may_spin(self, me: int) -> bool:
        now = time.monotonic_ns()
        return self.alone(me) and now > self._last[2] and not self.pressure.busy(now)

    def sole_client(self, now: int) -> bool:
        """While handling a request that came at `now`: is this connection the only active one?
        Then its client may spin for our reply (FLAG_SPIN)."""
        return len(self.busy) == 1 and not self.spinning and now > self._last[2] and not self.pressure.busy(now)

    def loop_may_spin(self, me: int) -> bool:
        """A serve loop (`kvpool.rpc.loop`), having answered connection `me`: may it poll `me` for
        the next request? Only when `me` sent the last request, no thread is handling one, and
        clients have not been interleaving (a spin there makes every other connection wait)."""
        now = time.monotonic_ns()
        last = self._last
        return last[0] == me and not self.busy and now > last[2] and not self.pressure.busy(now)

    def loop_sole_client(self, now: int) -> bool:
        """`sole_client` for a request a serve loop answers itself (no thread is busy for it)."""
        return not self.busy and now > self._last[2] and not self.pressure.busy(now)

    def calm(self) -> None:
        """Forget that clients were interleaving (tests)."""
        self._last[2] = 0


class LocalEndpoints:
    """The (host, port) pairs this process's RPC servers listen on and its clients connect
    from: a peer listed here needs this process's GIL to answer, so neither side spins for it.
    A fact about the process, hence one registry per process (`local`)."""

    _WILDCARD = ("0.0.0.0", "::", "")

    def __init__(self) -> None:
        self.servers: set[tuple[str, int]] = set()
        self.clients: set[tuple] = set()

    def serves(self, peer: tuple[str, int]) -> bool:
        """Is (host, port) one of this process's own servers? (False positives only cost speed.)"""
        return any(port == peer[1] and host in (peer[0], *self._WILDCARD) for host, port in list(self.servers))


local = LocalEndpoints()
