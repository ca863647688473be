"""A test network of Linux network namespaces: one namespace per member, all on one subnet
(`SUBNET`.0/24) through a hub namespace, with per-member shaping and one-way cuts.

    with Fabric(["etcd", "m0", "n0", "client"]).start() as net:
        net.ip("n0")                                   # "10.77.0.4"
        net.spawn("n0", ["kvpool", "node", ...], log)  # a process inside n0's namespace
        net.shape("n0", rate="10gbit", loss_pct=0.5)   # n0 sends at most 10 Gbit/s, 0.5% of what it receives is lost
        net.cut("m0", "etcd")                          # packets from m0 to etcd are dropped (etcd -> m0 still flows)
        net.heal()                                     # every cut healed

Links: with `delay_ms=0` each member's `eth0` is a veth into a bridge in the hub namespace (all
in the kernel). With `delay_ms > 0` each `eth0` is a TUN device of the delay line
(`kvpool.tools.netns.wire`, a process in the hub namespace) that holds every packet
`delay_ms` before delivering it: this kernel has no netem, so that is the latency there is
(the RTT between two members is about 2 x delay_ms plus the line's own time: measure it,
`rtt_ms`). Rates are tbf on each member's `eth0` (what it sends); loss and cuts are nft rules
in the receiving member's namespace (input hook), so a dropped packet is lost on the wire as
the sender sees it, not refused at its socket.

Nothing touches the host's own network: the bridge, the devices and the rules live inside the
fabric's namespaces, and names carry the owner's pid and a random tag (`kvn-<pid>-<tag>-<member>`),
so fabrics of parallel runs never meet. `close()` kills every process left in the namespaces
and deletes them (which takes their devices, qdiscs and rules along); a fabric whose owner died
without closing is reaped by the next `Fabric` that starts (`reap_stale`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from kvpool.tools.launch.processes import spawn, stop

log = logging.getLogger(__name__)

SUBNET = "10.77.0"  # private to each fabric: every fabric has its own hub, so parallel ones may share it
PREFIX = "kvn"
TABLE = "kvpool_net"
_NAME = re.compile(rf"^{PREFIX}-(\d+)-([0-9a-f]+)-(\S+)$")


def unavailable() -> str | None:
    """Why a fabric cannot be built here (not root, no `ip`, `nft` or `tc`), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "nft", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not installed (iproute2, nftables)"
    return None


@dataclass(frozen=True)
class Member:
    name: str
    netns: str
    ip: str


class Fabric:
    def __init__(self, names: Sequence[str], delay_ms: float = 0.0, log_dir: Path | None = None):
        if len(set(names)) != len(names) or not names or len(names) > 250:
            raise ValueError(f"member names must be 1-250 distinct names, got {list(names)}")
        self.tag = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(2)}"
        self.hub = f"{self.tag}-hub"
        self.members = {n: Member(n, f"{self.tag}-{n}", f"{SUBNET}.{i + 2}") for i, n in enumerate(names)}
        self.delay_ms = delay_ms
        self.log_dir = log_dir
        self.owner = True
        self.wire: subprocess.Popen | None = None
        self._wire_log: Path | None = None
        self.cuts: Counter[tuple[str, str]] = Counter()  # (src, dst) -> how many faults cut it
        self._lock = threading.Lock()  # cuts and rules change from several threads (fault lanes)
        self.loss: dict[str, float] = {}
        self.rates: dict[str, str] = {}

    # ------------------------------------------------------------------ life

    def start(self) -> "Fabric":
        why = unavailable()
        if why:
            raise RuntimeError(f"cannot build a namespace fabric: {why}")
        reap_stale()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        for netns in [self.hub, *(m.netns for m in self.members.values())]:
            _run("ip", "netns", "add", netns)
            _run("ip", "-n", netns, "link", "set", "lo", "up")
            _run("ip", "netns", "exec", netns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")
        if self.delay_ms > 0:
            self._start_wire()
        else:
            _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.hub, "link", "set", "br0", "up")
            for i, m in enumerate(self.members.values()):
                _run("ip", "link", "add", f"h{i}", "netns", self.hub, "type", "veth", "peer", "name", "eth0",
                     "netns", m.netns)
                _run("ip", "-n", self.hub, "link", "set", f"h{i}", "master", "br0", "up")
        for m in self.members.values():
            _run("ip", "-n", m.netns, "addr", "add", f"{m.ip}/24", "dev", "eth0")
            _run("ip", "-n", m.netns, "link", "set", "eth0", "up")
            self._nft(m.name)

    def _start_wire(self) -> None:
        log_path = self._wire_log = (self.log_dir or Path(tempfile.gettempdir())) / f"{self.tag}-wire.log"
        members = [f"--member={m.netns}={m.ip}" for m in self.members.values()]
        self.wire = spawn(["ip", "netns", "exec", self.hub, sys.executable, "-m", "kvpool.tools.netns.wire",
                           "--delay-ms", str(self.delay_ms), *members], log_path)
        deadline = time.monotonic() + 60
        while b"wire ready" not in log_path.read_bytes():
            if self.wire.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the delay line did not start: {log_path.read_text()[-2000:]}")
            time.sleep(0.05)

    def close(self) -> None:
        """Kill what runs inside, delete the namespaces (idempotent; an attached copy does nothing)."""
        if not self.owner:
            return
        stop(self.wire, 2.0)
        self.wire = None
        _delete([self.hub, *(m.netns for m in self.members.values())])
        if self.log_dir is None and self._wire_log is not None:  # nobody asked to keep it
            self._wire_log.unlink(missing_ok=True)

    def __enter__(self) -> "Fabric":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ members

    def ip(self, name: str) -> str:
        return self.members[name].ip

    def exec_prefix(self, name: str) -> list[str]:
        """Prefix a command with this to run it inside `name`'s namespace."""
        return ["ip", "netns", "exec", self.members[name].netns]

    def run(self, name: str, argv: Sequence[str], timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([*self.exec_prefix(name), *argv], capture_output=True, text=True, timeout=timeout)

    def spawn(self, name: str, argv: Sequence[str], log_path: str | Path | None = None,
              env: dict[str, str] | None = None, append: bool = False) -> subprocess.Popen:
        """`kvpool.tools.launch.processes.spawn` inside `name`'s namespace."""
        return spawn([*self.exec_prefix(name), *argv], log_path, env=env, append=append)

    # ------------------------------------------------------------------ shaping and cuts

    def shape(self, name: str, rate: str | None = None, loss_pct: float = 0.0) -> None:
        """What `name` sends leaves at most at `rate` (tc syntax: "10gbit"; None: unlimited), and
        `loss_pct` percent of the packets it receives are dropped at random."""
        netns = self.members[name].netns
        if rate:
            bits = rate_bits(rate)
            mtu = 65536 if self.delay_ms > 0 else 1514
            burst = max(2 * mtu, bits // 8 // 1000)  # a millisecond's worth, at least two packets
            _run("tc", "-n", netns, "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate,
                 "burst", str(burst), "latency", "5ms")
            self.rates[name] = rate
        elif name in self.rates:
            _run("tc", "-n", netns, "qdisc", "del", "dev", "eth0", "root")
            del self.rates[name]
        with self._lock:
            self.loss[name] = loss_pct
            self._nft(name)

    def cut(self, src: str, dst: str) -> None:
        """Packets from `src` to `dst` are dropped on arrival (one way; `dst` -> `src` still flows)."""
        self.cut_many([(src, dst)])

    def cut_many(self, pairs: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
        """Cut each (src, dst); returns them, for `heal`. Cuts are counted: a link two faults cut
        stays cut until both have healed it."""
        pairs = sorted(set(pairs))
        for src, dst in pairs:
            if src == dst or src not in self.members or dst not in self.members:
                raise ValueError(f"cannot cut {src} -> {dst}")
        with self._lock:
            new = [p for p in pairs if not self.cuts[p]]
            self.cuts.update(pairs)
            for dst in {d for _, d in new}:
                self._nft(dst)
        return pairs

    def partition(self, side_a: Iterable[str], side_b: Iterable[str], both: bool = True) -> list[tuple[str, str]]:
        """Cut every member of `side_a` from every member of `side_b` (a -> b; and b -> a when
        `both`). Returns the cuts made, for `heal`."""
        side_b = list(side_b)
        pairs = [(a, b) for a in side_a for b in side_b if a != b]
        if both:
            pairs += [(b, a) for a, b in pairs]
        return self.cut_many(pairs)

    def heal(self, pairs: Iterable[tuple[str, str]] | None = None) -> None:
        """Heal the given cuts, once each (every cut, however often made, when None)."""
        with self._lock:
            if pairs is None:
                healed, self.cuts = set(self.cuts), Counter()
            else:
                healed = set()
                for pair in set(pairs):
                    if self.cuts[pair] > 0:
                        self.cuts[pair] -= 1
                        if not self.cuts[pair]:
                            del self.cuts[pair]
                            healed.add(pair)
            for dst in {d for _, d in healed}:
                self._nft(dst)

    def _nft(self, name: str) -> None:
        """Rewrite `name`'s input rules (cuts towards it, random loss) in one atomic nft run."""
        m = self.members[name]
        sources = sorted(self.ip(src) for src, dst in self.cuts if dst == name)  # counts of 0 are deleted
        loss = int(round(self.loss.get(name, 0.0) * 100))  # in 1/10,000
        rules = [f"table inet {TABLE} {{", "  chain input {", "    type filter hook input priority 0; policy accept;"]
        if sources:
            rules.append(f"    ip saddr {{ {', '.join(sources)} }} drop")
        if loss > 0:
            rules.append(f"    numgen random mod 10000 < {loss} drop")
        rules += ["  }", "}"]
        script = f"table inet {TABLE}\ndelete table inet {TABLE}\n" + "\n".join(rules) + "\n"
        r = subprocess.run(["ip", "netns", "exec", m.netns, "nft", "-f", "-"], input=script, capture_output=True,
                           text=True)
        if r.returncode != 0:
            raise RuntimeError(f"nft in {m.netns} failed: {r.stderr.strip()}")

    # ------------------------------------------------------------------ handing it to a child process

    def describe(self) -> str:
        return json.dumps({"tag": self.tag, "delay_ms": self.delay_ms,
                           "members": {n: [m.netns, m.ip] for n, m in self.members.items()}})

    @classmethod
    def attach(cls, description: str) -> "Fabric":
        """A fabric another process built (`describe`): it may run, shape and cut, not close."""
        d = json.loads(description)
        net = cls.__new__(cls)
        net.tag, net.hub, net.delay_ms, net.log_dir = d["tag"], f"{d['tag']}-hub", d["delay_ms"], None
        net._wire_log = None
        net.members = {n: Member(n, ns, ip) for n, (ns, ip) in d["members"].items()}
        net.owner, net.wire, net.cuts, net.loss, net.rates = False, None, Counter(), {}, {}
        net._lock = threading.Lock()
        return net

    # ------------------------------------------------------------------ measuring it

    def probe_server(self, name: str) -> tuple[subprocess.Popen, int]:
        """A `kvpool.tools.netns.probe` server inside `name` (plain TCP: echo, get, put), and its port."""
        log_path = Path(tempfile.mkstemp(prefix=f"{self.tag}-probe-", suffix=".log")[1])
        proc = self.spawn(name, [sys.executable, "-m", "kvpool.tools.netns.probe", "serve", self.ip(name)], log_path)
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                found = re.search(rb"probe port (\d+)", log_path.read_bytes())
                if found:
                    return proc, int(found.group(1))
                if proc.poll() is not None:
                    raise RuntimeError(f"the probe server in {name} exited: {log_path.read_text()[-500:]}")
                time.sleep(0.05)
            stop(proc, 2.0)
            raise RuntimeError(f"the probe server in {name} did not start")
        finally:
            log_path.unlink(missing_ok=True)

    def rtt_ms(self, src: str, dst: str, samples: int = 50) -> dict[str, float]:
        """TCP round trips of one byte from `src` to `dst` (no `ping` here): min, p50, p90 in ms."""
        server, port = self.probe_server(dst)
        try:
            r = self.run(src, [sys.executable, "-m", "kvpool.tools.netns.probe", "rtt", self.ip(dst), str(port),
                               str(samples)])
            if r.returncode != 0:
                raise RuntimeError(f"round trips {src} -> {dst} failed: {r.stderr.strip()[-500:]}")
            xs = sorted(float(x) * 1e3 for x in r.stdout.split())
        finally:
            stop(server, 2.0)
        return {"min": round(xs[0], 3), "p50": round(xs[len(xs) // 2], 3), "p90": round(xs[len(xs) * 9 // 10], 3)}


def rate_bits(rate: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.strip().lower())
    if not m:
        raise ValueError(f"rate must look like 10gbit, 500mbit or 64kbit, got {rate!r}")
    return int(float(m.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m.group(2)])


def _run(*argv: str) -> None:
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {r.stderr.strip()}")


def _pids(netns: str) -> list[int]:
    r = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
    return [int(p) for p in r.stdout.split()] if r.returncode == 0 else []


def _delete(namespaces: list[str]) -> None:
    """SIGKILL every process inside (a stopped one too), then delete the namespaces."""
    existing = set(_list())
    for netns in namespaces:
        if netns not in existing:
            continue
        for _ in range(20):
            pids = _pids(netns)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        r = subprocess.run(["ip", "netns", "del", netns], capture_output=True, text=True)
        if r.returncode != 0:
            log.warning("could not delete namespace %s: %s", netns, r.stderr.strip())


def _list() -> list[str]:
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def reap_stale() -> list[str]:
    """Delete the namespaces of fabrics whose owner process is gone; returns their names."""
    stale = []
    for netns in _list():
        m = _NAME.match(netns)
        if m and not _alive(int(m.group(1))):
            stale.append(netns)
    if stale:
        log.info("reaping %d namespaces of dead fabrics", len(stale))
        _delete(stale)
    return stale


def _alive(pid: int) -> bool:
    from transfer.descriptor import pid_alive

    return pid_alive(pid)


__all__ = ["Fabric", "Member", "unavailable", "reap_stale", "rate_bits", "SUBNET"]
