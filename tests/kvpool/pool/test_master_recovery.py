"""A new leader master before every node has re-reported (found by issue 14's chaos campaign):
a remove of a key it does not know yet must not answer "not found", or the object comes back
with the node's report and a later get reads a key whose remove the caller saw succeed."""

from __future__ import annotations

import pytest

from kvpool.config import Settings
from kvpool.errors import Unavailable
from kvpool.master.service import MasterService
from kvpool.messages import Held, NodeInfo


def info(node_id: str) -> NodeInfo:
    return NodeInfo(node_id=node_id, address="127.0.0.1:1", hostname="h", segments=[], shm_path=None,
                    capacity={"dram": 1 << 20})


def test_remove_while_recovering_is_unavailable_then_removes_once_the_node_reported():
    m = MasterService(Settings(heartbeat_s=100.0))  # recovery lasts 300 s unless every node reports
    m.become_leader(expected_nodes=["n0", "n1"])
    m.register_node(info("n0"), [Held(key="a", size=10, tier="dram", put_id=1)])
    assert m.remove(["a"]) == [True]  # known: removed as usual
    with pytest.raises(Unavailable):
        m.remove(["b"])  # n1 may hold it: not "not found" yet
    with pytest.raises(Unavailable):
        m.exists(["b"])
    m.register_node(info("n1"), [Held(key="b", size=10, tier="ssd", put_id=2)])
    assert m.remove(["b"]) == [True]
    assert m.exists(["b"]) == [False]
    assert m.remove(["c"]) == [False]  # recovered: an unknown key is simply absent
