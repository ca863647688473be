"""The master's tables, each on its own invariants (`kvpool.master.nodes`, `objects`, `leases`,
`tombstones`, `outbox`), and the rules that span them on a `MasterService` in this process
(not started: no threads; the outbox is played by hand)."""

from __future__ import annotations

import time

import pytest

from kvpool.config import Settings
from kvpool.errors import AlreadyExists, InvalidArgument, KeyNotFound
from kvpool.master.nodes import NodeTable
from kvpool.master.objects import ObjectTable
from kvpool.master.outbox import CloseLink, Outbox, RemoveCopies
from kvpool.master.service import MasterService
from kvpool.master.tables import COMPLETE, PENDING
from kvpool.master.tombstones import Tombstones
from kvpool.messages import NodeInfo, Placed
from kvpool.tools.launch.processes import free_port


def info(node_id: str, address: str = "", cap: int = 10_000) -> NodeInfo:
    return NodeInfo(node_id=node_id, address=address or f"127.0.0.1:{1000 + len(node_id)}", hostname="h",
                    segments=[], shm_path=None, capacity={"dram": cap})


def tables(*node_ids: str) -> tuple[NodeTable, ObjectTable]:
    nodes = NodeTable()
    for n in node_ids:
        nodes.join(info(n, f"127.0.0.1:{2000 + ord(n[0])}"), time.monotonic(), 10.0)
    return nodes, ObjectTable(nodes)


def account_matches(nodes: NodeTable, objects: ObjectTable) -> None:
    for node in nodes:
        holding = [o for o in objects.values() if node.node_id in o.replicas]
        assert node.used == sum(o.size for o in holding), node.node_id
        assert node.objects == sum(o.state == COMPLETE for o in holding), node.node_id


# -- NodeTable --------------------------------------------------------------------------------

def test_a_live_node_is_not_re_pointed_but_a_silent_or_local_one_is():
    nodes = NodeTable()
    now = time.monotonic()
    nodes.join(info("a", "127.0.0.1:1"), now, 5.0)
    with pytest.raises(AlreadyExists, match="is live at 127.0.0.1:1"):
        nodes.join(info("a", "127.0.0.1:2"), now + 1.0, 5.0)
    assert nodes.get("a").address == "127.0.0.1:1"
    node, moved = nodes.join(info("a", "127.0.0.1:2"), now + 6.0, 5.0)  # silent past the timeout
    assert moved and node.address == "127.0.0.1:2"
    nodes.local.add("a")
    assert nodes.join(info("a", "127.0.0.1:3"), now + 6.5, 5.0)[1]  # in this process: always its own
    assert nodes.join(info("a", "127.0.0.1:3"), now + 7.0, 5.0)[1] is False


def test_a_banned_id_never_registers_again_and_dirt_goes_with_the_node():
    nodes = NodeTable()
    nodes.join(info("a"), time.monotonic(), 5.0)
    nodes.mark_dirty("a")
    nodes.mark_dirty("ghost")  # unknown: nothing to keep from a mark
    assert nodes.is_dirty("a") and not nodes.is_dirty("ghost")
    nodes.join(info("a"), time.monotonic(), 5.0)
    assert not nodes.is_dirty("a")  # registered again: its removals are known to it
    nodes.mark_dirty("a")
    nodes.drop("a")
    assert not nodes.is_dirty("a")
    nodes.banned.add("a")
    with pytest.raises(InvalidArgument, match="removed by an operator"):
        nodes.join(info("a"), time.monotonic(), 5.0)
    with pytest.raises(KeyNotFound):
        nodes.require("a")


def test_the_node_account_never_goes_below_zero():
    nodes = NodeTable()
    node, _ = nodes.join(info("a"), time.monotonic(), 5.0)
    nodes.add(node, 100)
    nodes.release("a", 300, counted=True)
    nodes.release("a", 300, counted=True)
    nodes.release("gone", 300, counted=True)  # a node that left has nothing to give back
    assert (node.used, node.objects) == (0, 0)


def test_every_node_local_means_no_node_re_reports():
    nodes = NodeTable()
    assert not nodes.all_local()  # nothing in this process: a remote node may join
    nodes.local.add("a")
    nodes.join(info("a"), time.monotonic(), 5.0)
    assert nodes.all_local()
    nodes.join(info("b"), time.monotonic(), 5.0)
    assert not nodes.all_local()


# -- ObjectTable ------------------------------------------------------------------------------

def test_a_put_charges_its_planned_nodes_and_publishes_only_what_landed():
    nodes, objects = tables("a", "b", "c")
    a, b, c = (nodes.get(n) for n in "abc")
    obj = objects.plan("t\x00k", 100, [a, b], put_id=7, deadline=0.0, token=0)
    assert (a.used, b.used, c.used) == (100, 100, 0) and obj.state == PENDING
    assert objects.used("t") == (200, 1)  # every planned replica counts for the tenant
    # b never wrote; c wrote a copy it was not planned for (left and came back meanwhile)
    published, gone = objects.publish(obj, [Placed("a", "dram", "seg", 0), Placed("c", "dram", "", 0)], 1.0)
    assert published and gone == ["c", "b"]  # copies that must be removed: unplanned first, then missed
    assert obj.state == COMPLETE and set(obj.replicas) == {"a"} and obj.replicas["a"].segment == "seg"
    assert (a.used, a.objects, b.used, c.used) == (100, 1, 0, 0)
    assert objects.used("t") == (100, 1)
    account_matches(nodes, objects)


def test_a_put_with_no_replica_landed_leaves_the_table():
    nodes, objects = tables("a", "b")
    obj = objects.plan("k", 50, [nodes.get("a"), nodes.get("b")], put_id=3, deadline=0.0, token=0)
    published, gone = objects.publish(obj, [], 1.0)
    assert not published and sorted(gone) == ["a", "b"]
    assert "k" not in objects and objects.used("") == (0, 0)
    account_matches(nodes, objects)


def test_the_last_replica_takes_the_object_along_and_a_lost_node_counts_what_it_lost():
    nodes, objects = tables("a", "b")
    a, b = nodes.get("a"), nodes.get("b")
    one = objects.plan("one", 10, [a, b], 1, 0.0, 0)
    objects.publish(one, [Placed("a", "dram", "", 0), Placed("b", "dram", "", 0)], 0.0)
    two = objects.plan("two", 20, [a], 2, 0.0, 0)
    objects.publish(two, [Placed("a", "dram", "", 0)], 0.0)
    objects.plan("open", 30, [a], 3, 0.0, 0)  # pending: lost, but never was an object
    objects.drop_replica(one, "b")
    assert "one" in objects and b.used == 0
    account_matches(nodes, objects)
    nodes.drop("a")
    assert objects.forget_node("a") == 2  # "one" and "two"; "open" goes without counting
    assert len(objects) == 0 and objects.used("") == (0, 0)


def test_the_ticks_candidates_cover_every_open_put_and_every_waiting_remove():
    nodes, objects = tables("a")
    a = nodes.get("a")
    due = objects.plan("due", 10, [a], 1, deadline=5.0, token=0)
    objects.plan("later", 10, [a], 2, deadline=50.0, token=0)
    done = objects.plan("done", 10, [a], 3, deadline=5.0, token=0)
    objects.publish(done, [Placed("a", "dram", "", 0)], 0.0)
    assert objects.due_puts(10.0) == [due]  # "done" is complete: dropped as a candidate
    assert objects.candidates()[0] == {"later"}
    leased = objects.get("done")
    leased.leases[1] = 20.0
    objects.start_removing(leased)
    assert objects.ended_removals(10.0) == []  # its reader still holds it
    assert [o.key for o in objects.removing_on("a")] == ["done"]
    assert objects.ended_removals(20.0) == [leased]
    assert objects.candidates()[1] == set()


def test_a_copy_in_flight_outlives_a_new_term():
    nodes, objects = tables("a")
    objects.copying.add("k")
    objects.clear()
    assert "k" in objects.copying  # the copy still ends; planning it again would orphan a replica
    objects.copying.discard("k")
    assert "k" not in objects.copying


# -- Tombstones -------------------------------------------------------------------------------

def test_a_tombstone_only_grows_and_an_older_one_expiring_keeps_the_newer():
    t = Tombstones(memory_s=10.0)
    t.remember("k", 5, now=0.0)
    t.remember("k", 3, now=1.0)  # an older remove changes nothing
    assert t.get("k") == 5
    t.remember("k", 9, now=4.0)
    t.expire(10.0)  # the remove at 5 is forgotten, the one at 9 is not
    assert t.get("k") == 9 and t.horizon == 5
    t.expire(14.0)
    assert len(t) == 0 and t.horizon == 9


def test_what_a_tombstone_and_the_horizon_refuse():
    t = Tombstones(memory_s=1.0)
    t.remember("gone", 100, now=0.0)
    assert t.refused("gone", 0, mark=0)  # a copy of unknown put
    assert t.refused("gone", 100, mark=0) and not t.refused("gone", 101, mark=0)
    t.remember("old", 50, now=0.0)
    t.expire(2.0)  # both forgotten: horizon 100
    assert t.horizon == 100 and len(t) == 0
    assert t.refused("old", 40, mark=99)  # the node cannot vouch for its copies below the horizon
    assert not t.refused("old", 40, mark=100)  # it can: every remove up to 100 reached it
    assert not t.refused("old", 101, mark=0)  # written after the horizon


def test_no_mark_reaches_a_remove_still_being_written_to_etcd():
    t = Tombstones(memory_s=1.0)
    assert t.bound(500) == 500
    t.recording.add(300)
    t.recording.add(400)
    assert t.bound(500) == 299
    t.recording.discard(300)
    assert t.bound(500) == 399
    t.remember("k", 450, now=0.0)
    t.expire(5.0)
    assert t.unsaved() == 450
    t.mark_saved(450)
    assert t.unsaved() == 0


# -- Outbox -----------------------------------------------------------------------------------

def test_a_node_is_busy_until_each_of_its_jobs_is_done_in_this_term():
    box = Outbox()
    box.remove("a", ["k1"], [1])
    box.copy("b", "127.0.0.1:1", "a", ["k2"], [2])
    box.close(object())
    jobs = [box.get_nowait() for _ in range(3)]
    assert [type(j).__name__ for j in jobs] == ["RemoveCopies", "CopyObjects", "CloseLink"]
    assert box.get_nowait() is None
    assert box.busy("a") and not box.busy("b")  # a copy keeps its target busy
    assert box.done(jobs[0]) and box.busy("a")
    assert box.done(jobs[1]) and not box.busy("a")
    box.remove("a", ["k3"], [3])
    old = box.get_nowait()
    box.new_term()
    assert not box.busy("a")
    box.remove("a", ["k4"], [4])
    assert not box.done(old)  # queued before the tables were cleared: it counts no more
    assert box.busy("a")


# -- the rules that span them -----------------------------------------------------------------

def service(**kw) -> MasterService:
    m = MasterService(Settings(heartbeat_s=100.0, **kw))
    m.become_leader()
    return m


def put(m: MasterService, key: str, node: str = "n0") -> int:
    plan = m.put_start(key, 10, 1, writer_node=node)
    m.put_end(key, plan.put_id, [Placed(node, "dram", "", 0)])
    return plan.put_id


def test_a_removed_object_leased_twice_goes_once_when_both_leases_end_together():
    m = service()
    m.register_node(info("n0"))
    put_id = put(m, "k")
    first, _ = m.lookup(["k"])
    second, _ = m.lookup(["k", "k"])
    assert m.remove(["k"]) == [True] and m.exists(["k"]) == [False]
    m.release([first, second])
    assert "k" not in m.state.objects and m.state.nodes.get("n0").used == 0
    jobs = []
    while (job := m.state.outbox.get_nowait()) is not None:
        jobs.append(job)
    assert jobs == [RemoveCopies("n0", ["k"], [put_id], m.state.outbox.term)]


def test_a_removal_that_fails_to_reach_a_node_holds_its_mark_until_it_registers_again():
    """A real link to a port where nothing listens: the outbox's removal fails, the node is
    told to register again (heartbeat known=False) and gets no mark until it does."""
    m = service()
    address = f"127.0.0.1:{free_port()}"
    m.register_node(info("n0", address))
    put(m, "k")
    assert m.remove(["k"]) == [True]
    job = m.state.outbox.get_nowait()
    assert isinstance(job, RemoveCopies) and job.node_id == "n0"
    mark = m.heartbeat("n0")[1]
    m.housekeeping.remove_copies(job)  # what the outbox thread does: the node cannot be reached
    assert m.heartbeat("n0") == (False, mark)
    m.register_node(info("n0", address))
    known, new_mark = m.heartbeat("n0")
    assert known and new_mark > mark
    m.drop_node("n0")
    assert isinstance(m.state.outbox.get_nowait(), CloseLink)  # its link is closed off the lock
    m.stop()
