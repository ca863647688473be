"""The campaign's checker: what the pool promises under faults, checked against every recorded
operation and the final read-back of every key.

The promises (README "Cluster mode", DESIGN "The master", and this campaign's sizing: the working
set stays below the pool's capacity, so nothing is evicted by policy; the checker reports the
master's eviction count so that this premise is checked too):

1. wrong_bytes: no read returns bytes other than the key's own (`values.value_of`), and a key
   never written reads as a miss.
2. wrong_match: `match_prefix` never counts past a key that was never written.
3. untyped_error: the SDK raises only `kvpool.errors` types.
4. replica_miss: a get (or remove) misses an acknowledged, not removed key only when every
   node holding a replica of it had a fault since the put, or the leader changed or stalled
   (`FAILOVER`) around the read. With `replicas >= 2`, one healthy replica is enough.
5. lost: after the campaign, with every fault healed, every acknowledged key that was never
   removed reads back, unless every node that held a replica of it was SIGKILLed (its DRAM is
   gone) or had its disk filled since the put (a pause or a cut link loses nothing: the node re-registers with
   what it holds).
6. resurrected: a key whose remove was acknowledged must read as a miss afterwards, unless a
   failover overlapped (counted apart, as stale_after_failover).
7. crashed: no process dies unless the schedule killed it (a negative exit is the signal).
8. slow_recovery: after each fault the pool serves again (a probe put + get) within
   `SERVE_BOUND_S` of the injection, and the faulted part is back within `RECOVER_BOUND_S` of
   the heal.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Iterable

from kvpool.tools.chaos.faults import NODE_LOSS, NODE_TARGETED

# Control-plane faults that change or pause the leader: the only ones that may explain a miss
# (a new leader rebuilds its index from the nodes' reports). A slow or cut client link, or a
# standby's death, must cost errors and time, never a miss. Across namespaces: the leader cut
# from etcd (either way) or from everyone, and etcd cut from everyone, end the leader's term.
FAILOVER = ("kill_leader", "pause_leader", "master_etcd_cut", "etcd_restart",
            "leader_etcd_partition", "leader_etcd_oneway", "leader_isolated", "etcd_isolated")

SERVE_BOUND_S = 30.0
RECOVER_BOUND_S = 30.0
GRACE_S = 3.0  # after a fault is healed and whole again, the index may lag one heartbeat or two


def read_ops(paths: Iterable[Path]) -> list[dict]:
    ops = []
    for p in paths:
        with open(p) as f:
            for line in f:
                try:
                    ops.append(json.loads(line))
                except ValueError:
                    pass  # a line cut by the client's SIGKILL-free stop cannot happen; a torn last line can
    return ops


class Windows:
    """Time windows of faults: per node (any node fault, and node loss), and the control plane."""

    def __init__(self, faults: list[dict], crashes: list[dict]):
        self.node_any: dict[str, list[tuple[float, float]]] = defaultdict(list)
        self.node_loss: dict[str, list[tuple[float, float]]] = defaultdict(list)
        self.control: list[tuple[float, float]] = []
        for f in faults:
            end = (f["t_whole"] or f["t_heal"] + RECOVER_BOUND_S) + GRACE_S
            span = (f["t_inject"], end)
            if f["kind"] in NODE_TARGETED:
                self.node_any[f["target"]].append(span)
                if f["kind"] in NODE_LOSS:
                    self.node_loss[f["target"]].append(span)
            elif f["kind"] in FAILOVER:
                self.control.append(span)
            for node in f.get("nodes") or ():  # a control-lane cut that took nodes off (no loss: a cut)
                self.node_any[node].append(span)
        for c in crashes:
            span = (c["t_last_ok"], c["t_seen"] + RECOVER_BOUND_S)
            target = self.node_any if c["name"].startswith("n") else None
            if target is None:
                self.control.append(span)
            else:
                self.node_any[c["name"]].append(span)
                self.node_loss[c["name"]].append(span)

    @staticmethod
    def hit(spans: list[tuple[float, float]], t0: float, t1: float) -> bool:
        return any(a <= t1 and b >= t0 for a, b in spans)


def check(ops: list[dict], faults: list[dict], crashes: list[dict], sweep: dict[str, str], sweep_t: float,
          evictions: int | None) -> dict:
    """`sweep`: key -> "ok" | "miss" | "wrong" | "err" from the final read-back."""
    w = Windows(faults, crashes)
    violations: list[dict] = []
    counts: Counter = Counter()
    puts: dict[str, dict] = {}
    removes: dict[str, dict] = {}
    for op in ops:
        counts[f"{op['op']}:{op['res']}"] += 1
        if op["op"] == "put" and op["res"] == "ok":
            puts[op["key"]] = op
        elif op["op"] == "remove":
            removes.setdefault(op["key"], op)

    def violation(kind: str, op: dict, why: str) -> None:
        violations.append({"kind": kind, "why": why, "op": op})

    transient = Counter()
    for op in ops:
        kind, res = op["op"], op["res"]
        if res == "wrong" and kind == "match":
            violation("wrong_match", op, f"match_prefix counted {op['n']} past a key never written")
        elif res == "wrong":
            violation("wrong_bytes", op, f"read {op.get('size')} bytes naming {op.get('names')!r}")
        elif res == "bad":
            violation("untyped_error", op, op.get("err", ""))
        elif res == "miss" and kind in ("get", "remove") and op["key"] in puts:
            put = puts[op["key"]]
            rm = removes.get(op["key"])
            if kind == "get" and rm is not None and rm["t0"] < op["t1"]:
                continue
            nodes = put.get("nodes")
            healthy = [n for n in nodes or [] if not w.hit(w.node_any[n], put["t0"], op["t1"])]
            if nodes is None:
                healthy = [] if any(w.hit(s, put["t0"], op["t1"]) for s in w.node_any.values()) else ["?"]
            if healthy and not w.hit(w.control, op["t0"] - GRACE_S, op["t1"]):
                violation("replica_miss", op,
                          f"replicas {nodes} ({put['rep']} asked), {healthy} had no fault since the put")
            else:
                transient[f"rep{put['rep']}"] += 1
        elif kind == "removed" and res == "ok":
            rm = removes[op["key"]]
            if w.hit(w.control, rm["t0"], op["t1"]):
                transient["stale_after_failover"] += 1
            else:
                violation("resurrected", op, f"read after its remove was acknowledged at {rm['t1']:.3f}")

    lost_excused = Counter()
    for key, res in sweep.items():
        put = puts[key]
        if res == "ok":
            continue
        if res == "wrong":
            violation("wrong_bytes", {"op": "sweep", "key": key}, "the final read-back returned other bytes")
            continue
        if res == "err":
            violation("lost", {"op": "sweep", "key": key, **put}, "the final read-back failed (an error, not a miss)")
            continue
        nodes = put.get("nodes")
        lost_with = [n for n in (nodes or []) if w.hit(w.node_loss[n], put["t0"], sweep_t)]
        if nodes is None:
            excused = any(w.hit(s, put["t0"], sweep_t) for s in w.node_loss.values())
        else:
            excused = len(lost_with) == len(nodes)
        if excused:
            lost_excused[f"rep{put['rep']}"] += 1
        else:
            violation("lost", {"op": "sweep", **put},
                      f"missing at the end; replicas {nodes}, of which only {lost_with} were killed or disk-full since")

    for c in crashes:
        violations.append({"kind": "crashed", "why": f"{c['name']} died by itself (exit {c['returncode']})", "op": c})
    for f in faults:
        if f["serve_s"] is None or f["serve_s"] > SERVE_BOUND_S:
            violations.append({"kind": "slow_recovery", "why": f"served again after {f['serve_s']} s", "op": f})
        elif f["recover_s"] is None or f["recover_s"] > RECOVER_BOUND_S:
            violations.append({"kind": "slow_recovery", "why": f"back after {f['recover_s']} s", "op": f})

    return {"violations": violations, "violation_counts": dict(Counter(v["kind"] for v in violations)),
            "op_counts": dict(sorted(counts.items())), "ops_checked": len(ops) + len(sweep),
            "acked_puts": len(puts), "swept": len(sweep), "sweep_ok": sum(1 for r in sweep.values() if r == "ok"),
            "misses_explained_by_faults": dict(transient), "lost_with_their_nodes": dict(lost_excused),
            "master_evictions": evictions}
