"""The fault schedule: two lanes of faults, each drawn from its own seeded random stream.

- node lane: one node at a time is SIGKILLed and restarted, SIGSTOPped for longer than its
  lease, cut off from etcd, squeezed by a memory cgroup (page cache reclaimed; the OOM killer if
  it grows), or (the node on a tmpfs) has its SSD filesystem filled.
- control lane: the leading master is SIGKILLed and restarted or SIGSTOPped past its lease,
  etcd is SIGKILLed and restarted, the leader's etcd link is cut, the link from the
  static-address clients to the leader is delayed, blackholed or cut, the clients' etcd link is
  cut, a standby master is SIGKILLed and restarted.

Across namespaces (a cluster on a `kvpool.tools.netns.Fabric`) every fault is a partition, made
of nft cuts between members' namespaces (a cut drops packets on arrival; the sender sees a lossy
link, not a refusal) and healed by removing them:

- node lane: a node from every master, both ways or one way (`node_master_oneway`: its
  requests arrive and the answers do not, or the reverse), but not from etcd or the clients; a
  node from etcd (both ways or one way); from the clients only; from everyone.
- control lane: the leader from etcd, both ways or one way; the leader from everyone; the leader
  from every node (it keeps etcd and the clients); the clients from the leader (they keep etcd
  and the nodes); the clients from etcd; etcd from everyone.
The campaign's own process (probes, the final read-back) is never cut.

A fault record: kind, target, t_inject, t_heal (wall clock), serve_s (injection to the first
probe put+get that succeeded: how long the pool stopped serving, 0 when it never did),
recover_s (heal to the faulted part being back: the node registered again, the masters all up
with a leader, and a probe served). Seeds make the schedule (kinds, targets, durations, gaps)
reproducible; wall-clock timings are not.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import kvpool
from kvpool.tools.chaos.cluster import ChaosCluster
from kvpool.tools.chaos.procs import Managed
from kvpool.tools.chaos.values import value_of
from kvpool.errors import KVPoolError

log = logging.getLogger(__name__)

# Faults after which a node's replicas may be gone for good (its DRAM died with it, or a demotion
# found no room on the full disk; memory pressure may end in the OOM killer).
NODE_LOSS = ("kill_node", "disk_full", "memory_pressure")
NODE_KINDS = {"kill_node": 3, "pause_node": 3, "node_etcd_cut": 2, "disk_full": 2, "memory_pressure": 2}
MEMORY_LIMIT = 3 << 20  # bytes a squeezed node may charge beyond what it held already
CONTROL_KINDS = {"kill_leader": 3, "pause_leader": 2, "etcd_restart": 2, "master_etcd_cut": 2,
                 "client_master_delay": 1, "client_master_blackhole": 1, "client_master_cut": 1,
                 "clients_etcd_cut": 1, "kill_standby": 1}
NETNS_NODE_KINDS = {"node_master_partition": 3, "node_master_oneway": 3, "node_etcd_partition": 2,
                    "node_etcd_oneway": 1, "node_clients_partition": 2, "node_isolated": 2}
NETNS_CONTROL_KINDS = {"leader_etcd_partition": 3, "leader_etcd_oneway": 3, "leader_isolated": 2,
                       "leader_nodes_partition": 2, "clients_leader_partition": 2, "clients_etcd_partition": 1,
                       "etcd_isolated": 1}
NODE_TARGETED = (*NODE_KINDS, *NETNS_NODE_KINDS)  # faults on one node, named by `target`


@dataclass
class Fault:
    lane: str
    kind: str
    target: str
    duration_s: float
    t_inject: float = 0.0
    t_heal: float = 0.0
    t_whole: float | None = None
    serve_s: float | None = None
    recover_s: float | None = None
    note: str = ""
    nodes: list[str] = field(default_factory=list)  # nodes cut off by a control-lane fault

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Crash:
    """A process that died without being killed by the schedule (a finding, then restarted)."""
    name: str
    returncode: int | None
    t_seen: float
    t_last_ok: float


@dataclass
class Lane:
    name: str
    cluster: ChaosCluster
    rng: random.Random
    kinds: dict[str, int]
    faults: list[Fault] = field(default_factory=list)
    crashes: list[Crash] = field(default_factory=list)
    probe_n: int = 0

    # ------------------------------------------------------------------ the loop

    def run(self, keep_going: Callable[[], bool]) -> None:
        last_ok = time.time()
        while keep_going():
            last_ok = self._restart_crashed(last_ok)
            kind = self.rng.choices(list(self.kinds), weights=list(self.kinds.values()))[0]
            if (kind == "disk_full" and self.cluster.full_disk is None) or (
                    kind == "memory_pressure" and self.cluster.memory_cgroup is None):
                kind = "kill_node"
            fault = self._draw(kind)
            try:
                self._one(fault)
            except Exception as exc:  # a fault that could not be injected or healed: keep the record
                log.exception("fault %s on %s failed", fault.kind, fault.target)
                fault.note = f"driver error: {exc!r}"[:300]
            self.faults.append(fault)
            log.info("fault %d (%s): %s on %s for %.1fs; serving after %s s, back after %s s", len(self.faults),
                     self.name, fault.kind, fault.target, fault.duration_s, _r(fault.serve_s), _r(fault.recover_s))
            time.sleep(self.rng.uniform(0.5, 1.5))

    def _draw(self, kind: str) -> Fault:
        r, c = self.rng, self.cluster
        node = r.choice(c.nodes)
        if kind == "disk_full":
            node = c.nodes[-1]
        if kind in NETNS_NODE_KINDS or kind in NETNS_CONTROL_KINDS:
            target = node.name if kind in NETNS_NODE_KINDS else "etcd" if kind == "etcd_isolated" else "leader"
            return Fault(self.name, kind, target, round(r.uniform(3, 7), 2))
        duration = {"kill_node": r.uniform(0.5, 3), "pause_node": r.uniform(4, 6), "node_etcd_cut": r.uniform(3, 6),
                    "disk_full": r.uniform(4, 8), "memory_pressure": r.uniform(4, 8),
                    "kill_leader": r.uniform(0.5, 3), "pause_leader": r.uniform(4, 6),
                    "etcd_restart": r.uniform(0.5, 3), "master_etcd_cut": r.uniform(3, 6),
                    "client_master_delay": r.uniform(3, 5), "client_master_blackhole": r.uniform(2, 4),
                    "client_master_cut": r.uniform(1, 3), "clients_etcd_cut": r.uniform(2, 4),
                    "kill_standby": r.uniform(0.5, 2)}[kind]
        target = node.name if kind in NODE_KINDS else {"etcd_restart": "etcd"}.get(kind, "leader")
        return Fault(self.name, kind, target, round(duration, 2))

    def _one(self, f: Fault) -> None:
        c = self.cluster
        heal = self._inject(f)
        f.t_inject = time.time()
        served: dict[str, float] = {}
        prober = threading.Thread(target=self._probe_until, args=(served, f.t_inject + 120), daemon=True)
        prober.start()
        time.sleep(max(0.0, f.t_inject + f.duration_s - time.time()))
        heal()
        f.t_heal = time.time()
        prober.join()
        f.serve_s = round(max(0.0, served["t"] - f.t_inject), 3) if "t" in served else None
        if self._whole(f, deadline=time.monotonic() + 120):
            f.t_whole = time.time()
            f.recover_s = round(f.t_whole - f.t_heal, 3)

    def _inject(self, f: Fault) -> Callable[[], None]:
        c = self.cluster
        if f.kind in NETNS_NODE_KINDS or f.kind in NETNS_CONTROL_KINDS:
            pairs = self._partition(f)
            return lambda: c.fabric.heal(pairs)
        if f.kind in NODE_KINDS:
            node = next(n for n in c.nodes if n.name == f.target)
            proxy = c.node_proxies[c.nodes.index(node)]
            if f.kind == "kill_node":
                node.kill()
                return lambda: node.start()
            if f.kind == "pause_node":
                node.pause()
                return node.resume
            if f.kind == "node_etcd_cut":
                proxy.cut()
                return proxy.heal
            if f.kind == "memory_pressure":
                squeezed = c.squeeze_memory(node, MEMORY_LIMIT)

                def heal() -> None:
                    f.note = squeezed()
                return heal
            filler = c.fill_disk()
            return lambda: filler.unlink(missing_ok=True)
        if f.kind == "etcd_restart":
            c.etcd.kill()
            return lambda: c.etcd.start()
        leader = c.leader() or c.masters[0]
        f.target = leader.name
        if f.kind == "kill_leader":
            leader.kill()
            return lambda: leader.start()
        if f.kind == "pause_leader":
            leader.pause()
            return leader.resume
        if f.kind == "kill_standby":
            standby = next(m for m in c.masters if m is not leader)
            f.target = standby.name
            standby.kill()
            return lambda: standby.start()
        if f.kind == "master_etcd_cut":
            proxy = c.master_proxies[c.masters.index(leader)]
            proxy.cut()
            return proxy.heal
        if f.kind == "clients_etcd_cut":
            f.target = "clients-etcd"
            c.client_etcd.cut()
            return c.client_etcd.heal
        lp = c.leader_proxy
        f.target = "clients-leader"
        if f.kind == "client_master_delay":
            lp.delay(round(self.rng.uniform(0.05, 0.3), 3))
        elif f.kind == "client_master_blackhole":
            lp.blackhole()
        else:
            lp.cut()
        return lp.heal

    def _partition(self, f: Fault) -> list[tuple[str, str]]:
        """Cut the links of partition fault `f` (nft rules in the fabric); returns the cuts."""
        c, net = self.cluster, self.cluster.fabric
        masters = [m.name for m in c.masters]
        nodes = [n.name for n in c.nodes]
        clients = [m for m in net.members if m.startswith("c")]
        everyone = [m for m in net.members if m != "observer"]  # the campaign's own view stays whole
        one_way = self.rng.random() < 0.5  # which direction a one-way cut drops
        if f.kind in NETNS_NODE_KINDS:
            node = f.target
            if f.kind == "node_master_partition":
                return net.partition([node], masters)
            if f.kind in ("node_master_oneway", "node_etcd_oneway"):
                far = masters if f.kind == "node_master_oneway" else ["etcd"]
                f.note = f"{node} -> {'masters' if far == masters else 'etcd'} dropped" if one_way else \
                    f"{'masters' if far == masters else 'etcd'} -> {node} dropped"
                return net.partition([node], far, both=False) if one_way else net.partition(far, [node], both=False)
            if f.kind == "node_etcd_partition":
                return net.partition([node], ["etcd"])
            if f.kind == "node_clients_partition":
                return net.partition([node], clients)
            return net.partition([node], everyone)  # node_isolated
        if f.kind == "etcd_isolated":
            f.nodes = nodes
            return net.partition(["etcd"], everyone)
        if f.kind == "clients_etcd_partition":
            f.target = "clients"
            return net.partition(clients, ["etcd"])
        leader = c.leader() or c.masters[0]
        f.target = leader.name
        if f.kind == "leader_etcd_partition":
            return net.partition([leader.name], ["etcd"])
        if f.kind == "leader_etcd_oneway":
            f.note = "leader -> etcd dropped" if one_way else "etcd -> leader dropped"
            return net.cut_many([(leader.name, "etcd")] if one_way else [("etcd", leader.name)])
        if f.kind == "leader_isolated":
            return net.partition([leader.name], everyone)
        if f.kind == "leader_nodes_partition":
            f.nodes = nodes
            return net.partition([leader.name], nodes)
        return net.partition(clients, [leader.name])  # clients_leader_partition

    # ------------------------------------------------------------------ is it serving, is it whole

    def probe(self, timeout: float = 3.0) -> bool:
        """A fresh key put (replicas 1) and read back through an etcd:// client, straight to etcd."""
        self.probe_n += 1
        key = f"probe-{self.name}-{self.probe_n}-{time.time_ns()}"
        try:
            with kvpool.connect(self.cluster.meta, timeout=timeout, use_shm=False) as pool:
                pool.put(key, value_of(key), replicas=1)
                ok = pool.get(key) == value_of(key)
                pool.remove(key)
                return ok
        except KVPoolError:
            return False

    def _probe_until(self, served: dict[str, float], give_up: float) -> None:
        while time.time() < give_up:
            if self.probe():
                served["t"] = time.time()
                return
            time.sleep(0.1)

    def _whole(self, f: Fault, deadline: float) -> bool:
        c = self.cluster
        while time.monotonic() < deadline:
            if f.kind in NODE_TARGETED:
                # Back: registered again since a kill, heartbeating since a pause or a cut.
                doc = (c.node_docs() or {}).get(f.target)
                ok = doc is not None and doc["heartbeat_age_s"] < 2 * c.heartbeat_s and (
                    f.kind != "kill_node" or doc["registered_at"] > f.t_inject)
            else:
                ok = c.etcd.alive and all(m.alive for m in c.masters) and c.leader() is not None
                if ok and f.nodes:  # and every node it cut off heartbeating again
                    docs = c.node_docs() or {}
                    ok = all(n in docs and docs[n]["heartbeat_age_s"] < 2 * c.heartbeat_s for n in f.nodes)
            if ok and self.probe():
                return True
            time.sleep(0.2)
        return False

    def _restart_crashed(self, last_ok: float) -> float:
        c = self.cluster
        mine: list[Managed] = list(c.nodes) if self.name == "node" else [*c.masters, c.etcd]
        for p in mine:
            if p.proc is not None and not p.alive:
                self.crashes.append(Crash(p.name, p.proc.returncode, time.time(), last_ok))
                log.warning("%s died by itself (exit %s); restarting it", p.name, p.proc.returncode)
                try:
                    p.start()
                except RuntimeError as exc:
                    log.error("restart of %s failed: %s", p.name, exc)
        return time.time()


def lanes(cluster: ChaosCluster, seed: int) -> list[Lane]:
    netns = cluster.fabric is not None
    return [Lane("node", cluster, random.Random(seed * 2 + 1), NETNS_NODE_KINDS if netns else NODE_KINDS),
            Lane("control", cluster, random.Random(seed * 2 + 2), NETNS_CONTROL_KINDS if netns else CONTROL_KINDS)]


def _r(x: float | None) -> str:
    return "never" if x is None else f"{x:.1f}"
