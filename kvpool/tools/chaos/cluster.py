"""The chaos cluster on loopback: etcd, 3 masters, 4 nodes (DRAM + SSD), and fault proxies.

    etcd <- [proxy per master] <- masters      (a master's etcd link can be cut: it must step down)
    etcd <- [proxy per node]   <- nodes        (a node's etcd link can be cut)
    etcd <- [clients' proxy]   <- etcd:// load clients
    leader <- [leader proxy]   <- static-address load clients (the proxy follows the leader, as a
                                  load balancer in front of the masters would)

One node's SSD directory sits on a tmpfs of its own (`ssd_mount_bytes`), so "disk full" fills a
real filesystem under a real lmdb; where mounting is not allowed (not root), that fault is off.

Across namespaces (`fabric`, a `kvpool.tools.netns.Fabric` with the members `NETNS_MEMBERS`):
etcd, each master and each node in a namespace of its own, listening on its member's address;
no proxies (links are cut with nft rules, `faults` partition kinds), so no disk-full fault
either. Listening off loopback needs authentication (protected mode): the cluster writes a
keyring (`keyring.toml`: the node principal and `chaos`, an admin the load clients and the
campaign speak as) and every process gets it.
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

import kvpool
from kvpool.tools.chaos.procs import Etcd, Service, start_all
from kvpool.tools.chaos.proxy import FaultProxy
from kvpool.tools.netns import Fabric
from kvpool.cluster import LEADER_KEY, EtcdClient
from kvpool.errors import KVPoolError

log = logging.getLogger(__name__)


def netns_members(masters: int = 3, nodes: int = 4, clients: int = 4) -> list[str]:
    """The fabric members a namespaced campaign needs: one per process, and the campaign's own."""
    return ["etcd", *(f"master{i}" for i in range(masters)), *(f"n{j}" for j in range(nodes)),
            *(f"c{k}" for k in range(clients)), "observer"]


class ChaosCluster:
    def __init__(self, workdir: Path, masters: int = 3, nodes: int = 4, heartbeat_s: float = 1.0,
                 dram: str = "4MiB", ssd: str = "40MiB", ssd_mount_bytes: int = 64 << 20,
                 fabric: Fabric | None = None):
        self.workdir = workdir
        self.heartbeat_s = heartbeat_s
        self.fabric = fabric
        self.master_proxies: list[FaultProxy] = []
        self.node_proxies: list[FaultProxy] = []
        self.masters: list[Service] = []
        self.nodes: list[Service] = []
        self.client_env: dict[str, str] = {}  # what a load client needs besides its address
        self.leader_proxy: FaultProxy | None = None
        self.full_disk: Path | None = None  # the tmpfs under the last node's SSD directory
        self.disk_note = ""
        self.memory_cgroup = _own_memory_cgroup() if fabric is None else None  # None: no memory-pressure faults
        self._stop = threading.Event()
        self._mounted = False
        hb = ["--heartbeat-s", str(heartbeat_s)]
        env: dict[str, str] = {}
        place = {}  # name -> Service/Etcd keyword arguments that put it in its namespace
        if fabric is not None:
            env = {"KVPOOL_AUTH_FILE": str(self._write_keyring())}
            self.client_env = {**env, "KVPOOL_PRINCIPAL": "chaos"}
            place = {m: {"host": fabric.ip(m), "prefix": fabric.exec_prefix(m)} for m in fabric.members}
            self.disk_note = "no disk-full faults across namespaces"
        self.etcd = Etcd(workdir, **place.get("etcd", {}))
        self.client_etcd = FaultProxy(self.etcd.address, "clients-etcd") if fabric is None else None
        for i in range(masters):
            meta = self.etcd.address
            if fabric is None:
                self.master_proxies.append(FaultProxy(self.etcd.address, f"m{i}-etcd"))
                meta = self.master_proxies[-1].address
            self.masters.append(Service(f"master{i}", workdir, ["master", "--meta", f"etcd://{meta}", *hb,
                                                                "--admin-port", "0"], env=env,
                                        **place.get(f"master{i}", {})))
        for j in range(nodes):
            meta = self.etcd.address
            if fabric is None:
                self.node_proxies.append(FaultProxy(self.etcd.address, f"n{j}-etcd"))
                meta = self.node_proxies[-1].address
            ssd_dir = workdir / f"ssd-n{j}"
            ssd_dir.mkdir(parents=True, exist_ok=True)
            if j == nodes - 1 and fabric is None:
                self._mount_tmpfs(ssd_dir, ssd_mount_bytes)
            self.nodes.append(Service(f"n{j}", workdir, ["node", "--meta", f"etcd://{meta}", *hb,
                                                         "--node-id", f"n{j}", "--dram-capacity", dram,
                                                         "--ssd-path", str(ssd_dir / "lmdb"),
                                                         "--ssd-capacity", ssd, "--admin-port", "0"], env=env,
                                      **place.get(f"n{j}", {})))

    def _write_keyring(self) -> Path:
        path = self.workdir / "keyring.toml"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f'[principals.node]\nrole = "node"\nsecret = "{secrets.token_hex(24)}"\n'
                    f'[principals.chaos]\nrole = "admin"\nsecret = "{secrets.token_hex(24)}"\n')
        return path

    def _mount_tmpfs(self, path: Path, size: int) -> None:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                           capture_output=True, text=True)
        if r.returncode == 0:
            self._mounted = True
            self.full_disk = path
            self.disk_note = f"node {path.name[4:]}'s SSD directory is a {size >> 20} MiB tmpfs"
        else:
            self.disk_note = f"no disk-full faults: mounting a tmpfs failed ({r.stderr.strip() or r.returncode})"

    # ------------------------------------------------------------------ lifecycle

    @property
    def meta(self) -> str:
        """etcd:// straight to etcd (no proxy): the campaign's own observer clients (and, across
        namespaces, every client)."""
        return f"etcd://{self.etcd.address}"

    def start(self) -> None:
        self.etcd.start()
        for p in [*self.master_proxies, *self.node_proxies, self.client_etcd]:
            if p is not None:
                p.start()
        start_all(self.masters)
        leader = self.wait_leader(30)
        if self.fabric is None:
            self.leader_proxy = FaultProxy(leader, "leader").start()
            threading.Thread(target=self._follow_leader, name="leader-follower", daemon=True).start()
        start_all(self.nodes)
        if not self.wait_nodes([n.name for n in self.nodes], 60):
            raise RuntimeError(f"the nodes did not all register; logs in {self.workdir}")

    def stop(self) -> None:
        self._stop.set()
        for s in [*self.nodes, *self.masters]:
            s.stop()
        self.etcd.stop()
        for p in [*self.master_proxies, *self.node_proxies, self.client_etcd, self.leader_proxy]:
            if p is not None:
                p.close()
        if self._mounted:
            subprocess.run(["umount", "-l", str(self.full_disk)], capture_output=True)
        if self.memory_cgroup is not None:  # a campaign stopped during memory pressure
            for child in self.memory_cgroup.glob(f"kvpool-chaos-{os.getpid()}-*"):
                try:
                    child.rmdir()
                except OSError:
                    pass

    # ------------------------------------------------------------------ what is up

    def leader_address(self) -> str | None:
        """The leader named in etcd (None when etcd is down or no master leads)."""
        try:
            etcd = EtcdClient(self.meta, timeout=1.0)
            try:
                value = etcd.get(LEADER_KEY)
            finally:
                etcd.close()
        except KVPoolError:
            return None
        return value.decode() if value else None

    def wait_leader(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            leader = self.leader_address()
            if leader:
                return leader
            time.sleep(0.1)
        raise RuntimeError(f"no leader master within {timeout}s")

    def leader(self) -> Service | None:
        addr = self.leader_address()
        return next((m for m in self.masters if m.address == addr), None)

    def _follow_leader(self) -> None:
        while not self._stop.wait(0.2):
            leader = self.leader_address()
            if leader and self.leader_proxy is not None and leader != self.leader_proxy.upstream:
                self.leader_proxy.retarget(leader)

    def node_docs(self, timeout: float = 3.0) -> dict[str, dict] | None:
        """The leader master's view of the nodes that are up (node id -> its admin document),
        or None when it cannot be asked."""
        try:
            with kvpool.connect(self.meta, timeout=timeout, use_shm=False) as c:
                return {n["node_id"]: n for n in c.admin("nodes") if n.get("state", "up") == "up"}
        except KVPoolError:
            return None

    def wait_nodes(self, names: list[str], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            up = self.node_docs()
            if up is not None and set(names) <= set(up):
                return True
            time.sleep(0.2)
        return False

    def arenas(self) -> list[str]:
        try:
            with kvpool.connect(self.meta, timeout=3, use_shm=False) as c:
                return [n["shm_path"] for n in c.admin("nodes") if n.get("shm_path")]
        except KVPoolError:
            return []

    def squeeze_memory(self, node: Service, limit: int) -> Callable[[], str]:
        """Memory pressure on one node: move it into a cgroup (v1) of its own whose memory limit
        is `limit` bytes beyond what it charges from now on (charges made before stay with the
        parent), so its page cache is reclaimed and a growing heap meets the OOM killer.
        Returns the heal, which lifts the limit, moves the node back and says what happened."""
        child = self.memory_cgroup / f"kvpool-chaos-{os.getpid()}-{node.name}"
        child.mkdir(exist_ok=True)
        (child / "memory.limit_in_bytes").write_text(str(limit))
        (child / "cgroup.procs").write_text(str(node.proc.pid))

        def heal() -> str:
            failcnt = (child / "memory.failcnt").read_text().strip()
            (child / "memory.limit_in_bytes").write_text("-1")
            code = None if node.alive else node.proc.returncode
            if code is None:
                (self.memory_cgroup / "cgroup.procs").write_text(str(node.proc.pid))
            child.rmdir()
            if code is not None:
                node.start()
                return f"OOM-killed (exit {code}), restarted; limit hit {failcnt} times"
            return f"limit hit {failcnt} times"

        return heal

    def fill_disk(self) -> Path | None:
        """Take every free byte of the SSD tmpfs (a file of zeros); returns the file to delete."""
        if self.full_disk is None:
            return None
        filler = self.full_disk / "filler"
        block = bytes(1 << 20)
        with open(filler, "wb", buffering=0) as f:
            try:
                while True:
                    f.write(block)
            except OSError:  # ENOSPC: the disk is full, as wanted
                pass
        return filler


def _own_memory_cgroup() -> Path | None:
    """This process's cgroup-v1 memory directory, when we may create children in it."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(","):
                d = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
                return d if (d / "memory.limit_in_bytes").exists() and os.access(d, os.W_OK) else None
    except (OSError, ValueError):
        pass
    return None
