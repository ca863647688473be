"""Helpers shared by the e2e tests (a module name no other test folder uses)."""

from __future__ import annotations

import os
import random
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from kvpool.tools.launch.local import LocalCluster, PoolSpec, RouterSpec
from kvpool.tools.launch.processes import KVPOOL, free_port, reap, spawn, terminate


def reference(rm, ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens of a single-process `model.generate` (stops after EOS, as the workers do)."""
    import torch

    with torch.inference_mode():
        out = rm.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(ids):].tolist()


def filler_ids(rm, n: int, seed: int) -> list[int]:
    """`n` token ids of word salad, different for each seed from the first token on."""
    rng = random.Random(seed)
    words = ("harbour ship pilot morning evening channel buoy north south river bridge market tower "
             "garden winter summer lantern engine signal anchor island coast letter number seven").split()
    text = f"Record {seed}: " + " ".join(rng.choice(words) for _ in range(n))
    ids = rm.encode(text)
    assert len(ids) >= n
    return ids[:n]


def assert_same_tokens(rm, ids: list[int], got: list[int], want: list[int]) -> None:
    """Equal tokens; on a flip, fail with the reference's top-2 logit margin at that step."""
    if got == want:
        return
    import torch

    i = next((k for k in range(min(len(got), len(want))) if got[k] != want[k]), min(len(got), len(want)))
    with torch.inference_mode():
        logits = rm.model(torch.tensor([ids + want[:i]])).logits[0, -1]
    top = torch.topk(logits, 2).values
    pytest.fail(f"greedy tokens differ at step {i}: got {got}, want {want}; reference top-2 margin there "
                f"{float(top[0] - top[1]):.3e} (a near-tie flip is a finding to report, not to loosen)")



class DeployedShape:
    """The topology compose and k8s deploy, as real processes on loopback: a standalone master
    (its admin API and /metrics at `master_admin`), one store node (its /metrics at `node_metrics`)
    and, on that pool, a `LocalCluster` of `workers` and the router. The node evicts LRU from a
    DRAM tier over an SSD tier, so which tier holds a chunk is predictable. Heartbeats: 0.2 s."""

    def __init__(self, workdir: Path, workers: list, dram: str = "128MiB"):
        self.workdir = Path(workdir)
        self.workers = workers
        self.dram = dram
        self.admin_port, self.node_port = free_port(), free_port()
        self.procs: list[subprocess.Popen] = []
        self.master_address = ""
        self.cluster: LocalCluster | None = None

    @property
    def master_admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    @property
    def node_metrics(self) -> str:
        return f"http://127.0.0.1:{self.node_port}/metrics"

    def _service(self, name: str, args: list[str], ready: str) -> str:
        log = self.workdir / f"{name}.log"
        popen = spawn([*KVPOOL, *args], log, env=dict(os.environ))
        self.procs.append(popen)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for line in log.read_text(errors="replace").splitlines():
                if line.startswith(ready):
                    return line.split()[-1]
            if popen.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"{name} did not start:\n{log.read_text(errors='replace')[-3000:]}")

    def start(self) -> "DeployedShape":
        try:
            self.master_address = self._service("master", [
                "master", "--host", "127.0.0.1", "--port", "0", "--admin-port", str(self.admin_port),
                "--heartbeat-s", "0.2"], "kvpool master at ")
            self._service("node", [
                "node", "--host", "127.0.0.1", "--port", "0", "--master", self.master_address, "--node-id", "node-a",
                "--admin-port", str(self.node_port), "--heartbeat-s", "0.2", "--dram-capacity", self.dram,
                "--eviction", "lru", "--ssd-path", str(self.workdir / "ssd"), "--ssd-capacity", "2GiB"],
                "kvpool node ")
            self.cluster = LocalCluster(self.workdir, self.workers, PoolSpec(address=self.master_address),
                                        env={"KVPOOL_LOG_LEVEL": "INFO"}, router=RouterSpec())
            self.cluster.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None
        for popen in reversed(self.procs):
            terminate(popen)
        for popen in reversed(self.procs):
            reap(popen)
        self.procs.clear()


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted label pairs): value} of a Prometheus /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url, timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}
