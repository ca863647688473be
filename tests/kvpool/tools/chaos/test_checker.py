"""The chaos checker on hand-written operation records: it flags what breaks a promise and
excuses only what a fault explains (kvpool.tools.chaos.checker)."""

from __future__ import annotations

from kvpool.tools.chaos.checker import check


def put(key, t, rep=1, nodes=("n0",)):
    return {"t0": t, "t1": t + 0.01, "op": "put", "key": key, "rep": rep, "res": "ok", "nodes": list(nodes)}


def get(key, t, res="ok", op="get", **extra):
    return {"t0": t, "t1": t + 0.01, "op": op, "key": key, "res": res, **extra}


def fault(kind, target, t, heal, lane="node"):
    return {"lane": lane, "kind": kind, "target": target, "duration_s": heal - t, "t_inject": t, "t_heal": heal,
            "t_whole": heal + 0.5, "serve_s": 0.1, "recover_s": 0.5, "note": ""}


def kinds(report):
    return sorted(v["kind"] for v in report["violations"])


def test_a_clean_history_has_no_violation():
    ops = [put("a", 1), get("a", 2), get("never", 3, res="miss", op="absent")]
    r = check(ops, [], [], {"a": "ok"}, 10, 0)
    assert r["violations"] == [] and r["acked_puts"] == 1 and r["ops_checked"] == 4


def test_wrong_bytes_and_wrong_match_are_violations():
    ops = [put("a", 1), get("a", 2, res="wrong", size=10, names="b"),
           {"t0": 3, "t1": 3.1, "op": "match", "keys": ["a", "x", "a"], "n": 2, "res": "wrong"}]
    assert kinds(check(ops, [], [], {"a": "wrong"}, 10, 0)) == ["wrong_bytes", "wrong_bytes", "wrong_match"]


def test_a_miss_is_excused_only_by_a_fault_on_every_replica_node():
    ops = [put("a", 1, rep=2, nodes=("n0", "n1")), get("a", 20, res="miss"),
           put("b", 1, rep=2, nodes=("n0", "n2")), get("b", 20, res="miss")]
    faults = [fault("kill_node", "n0", 5, 6), fault("pause_node", "n1", 10, 14)]
    r = check(ops, faults, [], {}, 30, 0)
    assert kinds(r) == ["replica_miss"] and r["violations"][0]["op"]["key"] == "b"  # n2 was healthy
    assert r["misses_explained_by_faults"] == {"rep2": 1}


def test_a_control_plane_fault_during_a_read_excuses_its_miss():
    ops = [put("a", 1), get("a", 20, res="miss")]
    assert check(ops, [fault("kill_leader", "master0", 19, 21, lane="control")], [], {}, 30, 0)["violations"] == []
    assert kinds(check(ops, [fault("kill_leader", "master0", 5, 6, lane="control")], [], {}, 30, 0)) == ["replica_miss"]


def test_lost_at_the_end_only_with_its_nodes_killed():
    ops = [put("a", 1, nodes=("n0",)), put("b", 1, nodes=("n1",)), put("c", 1, nodes=("n2",))]
    faults = [fault("kill_node", "n0", 5, 6), fault("pause_node", "n1", 5, 10)]
    r = check(ops, faults, [], {"a": "miss", "b": "miss", "c": "ok"}, 30, 0)
    assert kinds(r) == ["lost"] and r["violations"][0]["op"]["key"] == "b"  # a pause loses nothing
    assert r["lost_with_their_nodes"] == {"rep1": 1}


def test_a_read_after_an_acknowledged_remove_is_a_resurrection():
    ops = [put("a", 1), {"t0": 2, "t1": 2.1, "op": "remove", "key": "a", "res": "ok"}, get("a", 3, op="removed")]
    assert kinds(check(ops, [], [], {}, 10, 0)) == ["resurrected"]
    r = check(ops, [fault("kill_leader", "master0", 2.5, 2.6, lane="control")], [], {}, 10, 0)
    assert r["violations"] == [] and r["misses_explained_by_faults"] == {"stale_after_failover": 1}


def test_a_fault_the_pool_did_not_recover_from_is_a_violation():
    slow = {**fault("kill_node", "n0", 1, 2), "serve_s": None}
    assert kinds(check([], [slow], [], {}, 10, 0)) == ["slow_recovery"]


def test_a_process_that_died_by_itself_is_a_violation():
    crash = {"name": "n3", "returncode": -7, "t_seen": 5.0, "t_last_ok": 4.0}
    assert kinds(check([], [], [crash], {}, 10, 0)) == ["crashed"]
