"""The master's tombstones and node marks (issue 29, `kvpool.master.state`), on a `MasterService`
in this process, its outbox drained by hand: when a mark may move, and what a re-report with an
old mark may bring back. (The same rules end to end: tests/kvpool/cluster/test_resurrection.py.)"""

from __future__ import annotations

import time

from kvpool.config import Settings
from kvpool.master.outbox import RemoveCopies
from kvpool.master.service import MasterService
from kvpool.messages import Held, NodeInfo, Placed


def info(node_id: str) -> NodeInfo:
    return NodeInfo(node_id=node_id, address=f"127.0.0.1:{1 + int(node_id[1:])}", hostname="h", segments=[],
                    shm_path=None, capacity={"dram": 1 << 20})


def put(m: MasterService, key: str, nodes: tuple[str, ...] = ("n0",)) -> int:
    plan = m.put_start(key, 10, len(nodes), writer_node=nodes[0])
    assert sorted(t.node_id for t in plan.targets) == sorted(nodes)
    m.put_end(key, plan.put_id, [Placed(n, "dram", "", 0) for n in nodes])
    return plan.put_id


def drain_outbox(m: MasterService) -> list[RemoveCopies]:
    """Play the outbox thread whose removals all succeed."""
    st, done = m.state, []
    while (job := st.outbox.get_nowait()) is not None:
        if isinstance(job, RemoveCopies):
            with st.lock:
                st.done_locked(job)
            done.append(job)
    return done


def forget_tombstones(m: MasterService) -> None:
    with m.state.lock:
        m.state.tombstones.expire(time.monotonic() + m.state.tombstones.memory_s + 1)


def leader() -> MasterService:
    m = MasterService(Settings(heartbeat_s=100.0, removal_memory_s=60.0))  # no threads: time stands still
    m.become_leader()
    m.register_node(info("n0"), [])
    return m


def test_a_nodes_mark_waits_for_its_removals_and_readers():
    m = leader()
    put(m, "k")
    lease, _ = m.lookup(["k"])
    assert m.remove(["k"]) == [True]  # deferred: a reader holds a lease
    tomb = m.state.tombstones.get("k")
    known, mark = m.heartbeat("n0")
    assert known and mark < tomb  # the node still holds the copy
    m.release([lease])  # the removal is queued for the node
    assert m.heartbeat("n0")[1] < tomb
    assert [(job.node_id, job.keys) for job in drain_outbox(m)] == [("n0", ["k"])]
    assert m.heartbeat("n0")[1] >= tomb


def test_a_pending_put_on_a_node_holds_its_mark_below_the_put():
    m = leader()
    plan = m.put_start("p", 10, 1)
    assert m.heartbeat("n0")[1] < plan.put_id  # the node must still accept this put's bytes
    m.put_end("p", plan.put_id, [Placed("n0", "dram", "", 0)])
    assert m.heartbeat("n0")[1] >= plan.put_id


def test_a_node_whose_mark_is_below_the_horizon_keeps_only_copies_it_can_vouch_for():
    m = leader()
    m.register_node(info("n1"), [])
    old_mark = m.heartbeat("n0")[1]
    live = put(m, "live", ("n0", "n1"))  # n1's replica keeps it known
    dropped = put(m, "dropped")  # its only replica, n0, is forgotten below
    gone = put(m, "gone")
    assert m.remove(["gone", "never-written"]) == [True, False]
    drain_outbox(m)
    forget_tombstones(m)
    assert not len(m.state.tombstones) and m.state.tombstones.horizon > gone
    newer = put(m, "newer")  # after the horizon
    m.drop_node("n0")  # paused past its lease: its copies are forgotten

    # n0 comes back with its old mark: the forgotten tombstones might cover any of its old copies.
    m.register_node(info("n0"), [Held("live", 10, "dram", live), Held("dropped", 10, "dram", dropped),
                                  Held("gone", 10, "dram", gone), Held("never-written", 10, "dram", 0),
                                  Held("newer", 10, "dram", newer)], mark=old_mark)
    assert m.exists(["live", "dropped", "gone", "never-written", "newer"]) == [True, False, False, False, True]
    assert len(m.admin.key_info("live")["replicas"]) == 2
    refused = [job for job in drain_outbox(m) if job.node_id == "n0"]
    assert sorted(refused[0].keys) == ["dropped", "gone", "never-written"]


def test_a_node_with_a_recent_mark_is_trusted_past_the_horizon():
    m = leader()
    kept = put(m, "kept")
    gone = put(m, "gone")
    assert m.remove(["gone"]) == [True]
    drain_outbox(m)
    mark = m.heartbeat("n0")[1]
    forget_tombstones(m)
    assert mark >= m.state.tombstones.horizon > gone
    m.drop_node("n0")  # e.g. a failover: the master knows nothing of n0's copies
    m.register_node(info("n0"), [Held("kept", 10, "dram", kept)], mark=mark)
    assert m.exists(["kept", "gone"]) == [True, False]


def test_a_remove_answered_not_found_still_refuses_older_copies():
    m = leader()
    m.register_node(info("n1"), [])
    p = put(m, "k")
    m.drop_node("n0")  # its copy is unknown to the master now
    assert m.remove(["k"]) == [False]
    m.register_node(info("n0"), [Held("k", 10, "dram", p)], mark=m.state.ids.last)
    assert m.exists(["k"]) == [False]
    newer = m.put_start("k", 10, 1)  # a put after the remove is not covered by it
    assert newer.put_id > m.state.tombstones.get("k")
