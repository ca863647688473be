"""Property test of the master's tables: any sequence of puts, ends, aborts, lookups, releases,
removes, evictions, node joins and losses keeps the accounting exact (per node, and each tenant's
use that its pool-wide quota is checked against) and never shows a reader an object that is not
complete. (The service is not started: no threads, no node links.)"""

from __future__ import annotations

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.config import Settings
from kvpool.errors import KVPoolError
from kvpool.master.quotas import QuotaTable
from kvpool.master.service import MasterService
from kvpool.master.tables import COMPLETE
from kvpool.messages import Held, NodeInfo, Placed

KEYS = st.sampled_from([f"{t}k{i}" for i in range(8) for t in ("", "acme\x00", "beta\x00") if i < 4 or not t])
NODES = st.sampled_from(["a", "b", "c"])


def info(node_id: str, cap: int = 10_000) -> NodeInfo:
    return NodeInfo(node_id=node_id, address=f"127.0.0.1:{1000 + ord(node_id)}", hostname="h", segments=[],
                    shm_path=None, capacity={"dram": cap})


class MasterMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.m = MasterService(Settings(replicas=1, put_timeout_s=1000))
        self.m.state.quotas = QuotaTable({"acme": (6000, 3)})  # pool-wide (kvpool.master.quotas): some puts are refused
        self.puts: dict[str, tuple[int, list[str]]] = {}  # key -> (put_id, target nodes) of open puts
        self.leases: list[int] = []
        for n in ("a", "b"):
            self.m.register_node(info(n))

    @rule(key=KEYS, size=st.integers(1, 4000), replicas=st.integers(1, 3), writer=st.sampled_from(["", "a", "c"]))
    def put_start(self, key, size, replicas, writer):
        try:
            plan = self.m.put_start(key, size, replicas, writer)
        except KVPoolError:
            return
        if not plan.exists:
            self.puts[key] = (plan.put_id, [t.node_id for t in plan.targets])

    @precondition(lambda self: self.puts)
    @rule(data=st.data(), landed=st.integers(0, 3))
    def put_end(self, data, landed):
        key = data.draw(st.sampled_from(sorted(self.puts)))
        put_id, targets = self.puts.pop(key)
        written = [Placed(n, "dram", "", 0) for n in targets[:landed]]
        try:
            self.m.put_end(key, put_id, written)
        except KVPoolError:
            return

    @rule(keys=st.lists(KEYS, max_size=4))
    def lookup(self, keys):
        lease_id, entries = self.m.lookup(keys)
        for key, entry in zip(keys, entries):
            obj = self.m.state.objects.get(key)
            if entry is not None:
                assert obj is not None and obj.state == COMPLETE and not obj.removing
                assert entry.size == obj.size and entry.locations
        if lease_id:
            self.leases.append(lease_id)

    @precondition(lambda self: self.leases)
    @rule()
    def release(self):
        self.m.release([self.leases.pop(0)])

    @rule(keys=st.lists(KEYS, max_size=3))
    def remove(self, keys):
        self.m.remove(keys)

    @rule(nbytes=st.integers(0, 8000))
    def evict(self, nbytes):
        self.m.admin.evict(target_bytes=nbytes)

    @rule(node=NODES)
    def join(self, node):
        held = [Held(k, o.size, "dram", o.put_id) for k, o in list(self.m.state.objects.items())[:2] if o.state == COMPLETE]
        try:
            self.m.register_node(info(node), held)
        except KVPoolError:
            pass

    @rule(node=NODES)
    def lose(self, node):
        self.m.drop_node(node)

    @rule(node=NODES, drain=st.booleans())
    def drain(self, node, drain):
        try:
            (self.m.admin.drain_node if drain else self.m.admin.undrain_node)(node)
        except KVPoolError:
            pass

    @rule()
    def tick(self):
        self.m.housekeeping.tick()

    @invariant()
    def accounting_is_exact(self):
        m = self.m
        for node in m.state.nodes.values():
            holding = [o for o in m.state.objects.values() if node.node_id in o.replicas]
            assert node.used == sum(o.size for o in holding), node.node_id
            assert node.objects == sum(o.state == COMPLETE for o in holding), node.node_id
        for obj in m.state.objects.values():
            assert set(obj.replicas) <= set(m.state.nodes.ids())
            if obj.state == COMPLETE:
                assert obj.replicas, obj.key
        usage: dict[str, list[int]] = {}
        for key, obj in m.state.objects.items():  # each tenant's use, as the quotas count it
            use = usage.setdefault(key.partition("\x00")[0] if "\x00" in key else "", [0, 0])
            use[0] += obj.size * len(obj.replicas)
            use[1] += 1
        assert m.state.objects.usage == usage
        # the housekeeping tick looks only at its candidates: they must cover every open put and
        # every remove waiting for a lease, or a put would never be reclaimed, a remove never end
        pending, removing = m.state.objects.candidates()
        assert {k for k, o in m.state.objects.items() if o.state != COMPLETE} <= pending
        assert {k for k, o in m.state.objects.items() if o.removing} <= removing
        visible = {k for k, o in m.state.objects.items() if o.visible()}
        assert {k for k, v in zip(sorted(visible), m.exists(sorted(visible))) if v} == visible


TestMasterMachine = MasterMachine.TestCase
TestMasterMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_tick_reclaims_timed_out_puts_and_ends_removes_whose_leases_expired():
    """The housekeeping tick's two jobs, on the candidates it keeps instead of scanning every
    object: a put never ended is reclaimed after put_timeout_s; a remove that waited for a lease
    frees the object once the lease has expired; a thousand complete objects leave it nothing to do."""
    import time

    m = MasterService(Settings(replicas=1, put_timeout_s=0.05))
    m.register_node(info("a", cap=1 << 20))
    for i in range(1000):
        plan = m.put_start(f"done{i}", 10, 1, "")
        m.put_end(f"done{i}", plan.put_id, [Placed("a", "dram", "", 0)])
    open_put = m.put_start("open", 10, 1, "")
    plan = m.put_start("leased", 10, 1, "")
    m.put_end("leased", plan.put_id, [Placed("a", "dram", "", 0)])
    m.state.tunables.lease_s = 0.05
    m.lookup(["leased"])
    assert m.remove(["leased"]) == [True]
    assert m.state.objects.get("leased").removing
    m.housekeeping.tick()  # nothing is due yet
    assert m.state.objects.get("open").put_id == open_put.put_id and "leased" in m.state.objects
    time.sleep(0.1)
    m.housekeeping.tick()
    assert "open" not in m.state.objects and "leased" not in m.state.objects
    assert m.state.objects.candidates() == (set(), set())
    assert m.state.nodes.get("a").used == 1000 * 10 and len(m.state.objects) == 1000
