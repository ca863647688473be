"""The partition campaign (issue 29): the chaos cluster across network namespaces (etcd, 3
masters, 4 nodes, 4 load clients, each in its own; the campaign's probes in one more), every
fault an nft partition: a master from etcd (both ways, one way), a node from the masters but
not from the clients, asymmetric cuts, the leader or etcd from everyone. At least 10 minutes
and 50 partitions, then every operation and every key through the same checker as on loopback.

`make test-slow` runs it (root, iproute2, nftables, etcd). KVPOOL_CHAOS_SEED replays a schedule;
KVPOOL_CHAOS_DURATION and KVPOOL_CHAOS_MIN_FAULTS shorten it while developing."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from kvpool.tools.chaos.command import summary
from kvpool.tools.chaos.campaign import run_campaign
from kvpool.tools.chaos.faults import NETNS_CONTROL_KINDS, NETNS_NODE_KINDS
from kvpool.tools.chaos.procs import etcd_binary
from kvpool.tools.netns import unavailable

pytestmark = pytest.mark.slow


@pytest.mark.timeout(3 * 3600)
def test_partitions_break_no_promise(tmp_path):
    if unavailable() is not None:
        pytest.skip(f"no namespace fabric here: {unavailable()}")
    if etcd_binary() is None:
        pytest.skip("etcd is not installed (make system-deps)")
    seed = int(os.environ.get("KVPOOL_CHAOS_SEED", "1"))
    duration = float(os.environ.get("KVPOOL_CHAOS_DURATION", "600"))
    min_faults = int(os.environ.get("KVPOOL_CHAOS_MIN_FAULTS", "50"))
    report = run_campaign(tmp_path, seed=seed, duration_s=duration, min_faults=min_faults, netns=True)
    (tmp_path / "report.json").write_text(json.dumps(report, indent=1, default=str))
    print(summary(report))
    print(f"report: {tmp_path / 'report.json'}")
    assert report["duration_s"] >= duration
    assert len(report["faults"]) >= min_faults
    assert {f["kind"] for f in report["faults"]} <= {*NETNS_NODE_KINDS, *NETNS_CONTROL_KINDS}
    assert report["ops_checked"] > 10 * len(report["faults"])
    assert report["violations"] == [], summary(report)
    ours = [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
            if n.startswith(f"kvn-{os.getpid()}-")]
    assert ours == []  # the fabric is gone
