"""`kvpool bench pool --workload netns`: the pool's gets and puts across a shaped link between two network
namespaces, against a raw socket over the same link, and that link's nominal rate.

Setup (root): a `kvpool.tools.netns.Fabric` of two members, "client" and "server". With
`rtt_ms` > 0 their link goes through the fabric's delay line (this kernel has no netem), its
one-way delay calibrated so that the measured TCP round trip of one byte is about `rtt_ms`
(the line adds ~0.1-0.3 ms of its own; the round trips measured before and after the bench are
in the report); `link_rate` is a tbf on both members' links; `loss_pct` drops that share of the
packets each member receives. The pool (`kvpool serve`, with a keyring: protected mode refuses
to listen off loopback without one; the client is a tenant) runs in "server". The bench itself
runs in a child process inside "client" (`python -m kvpool.tools.bench.pool_netns`), where
the parent follows its log and prints its report.

Systems, in turns as in `kvpool bench pool` (same workloads, one value per call, batches of
`--batch`, the same alternation and checks): `ours_tcp` (SDK, node RPC path), `ours_tcp-engine`
(transfer engine over TCP), and `raw_tcp`, the baseline: `kvpool.tools.netns.probe`'s store, a
dict behind a socket in "server" (a get is one request and one payload; a batch sends every
request, then reads every answer). Rows also carry `link_share`: the figure over the link's
nominal rate. And `stream_raw_tcp`: one TCP stream of `STREAM_BYTES` against the nominal rate,
what this machine pushes through the link at all (the ceiling of every row).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.tools.bench.report import Report, Result, gbps
from kvpool.tools.launch.processes import follow, stop
from kvpool.tools.netns import Fabric
from kvpool.tools.netns import probe
from kvpool.tools.netns.fabric import rate_bits

log = logging.getLogger(__name__)

STREAM_BYTES = 256 << 20
STREAM_REPS = 5


def run_across(as_json: bool, sizes: list[int], per_rep: int, min_ops: int, reps: int, batch: int, no_put: bool,
               no_engine: bool, rtt_ms: float, rate: str | None, loss_pct: float) -> None:
    """Build the link, run the bench inside "client", print its report; the link goes after."""
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-netns-") as folder:
        out, log_path = Path(folder) / "report.json", Path(folder) / "bench.log"
        net, delay_ms, rtt_before = _link(rtt_ms, rate, loss_pct, Path(folder))
        with net:
            argv = [sys.executable, "-m", "kvpool.tools.bench.pool_netns", "--fabric", net.describe(),
                    "--out", str(out), "--sizes", ",".join(map(str, sizes)), "--per-rep", str(per_rep), "--min-ops", str(min_ops),
                    "--reps", str(reps), "--batch", str(batch), "--rate", rate or ""]
            argv += ["--no-put"] * no_put + ["--no-engine"] * no_engine
            inside = net.spawn("client", argv, log_path)
            follow(inside, log_path)
            rtt_after = net.rtt_ms("client", "server", 200) if inside.returncode == 0 else None
        if inside.returncode != 0 or not out.exists():
            raise RuntimeError(f"the bench inside the namespaces failed (exit {inside.returncode}): "
                               f"{log_path.read_text(errors='replace')[-3000:]}")
        doc = json.loads(out.read_text())
    report = Report("pool")
    report.results = [Result(**r) for r in doc["results"]]
    report.notes = doc.get("notes", [])
    report.setup = {**doc.get("setup", {}), "rtt_target_ms": rtt_ms, "delay_ms_each_way": round(delay_ms, 3),
                    "rtt_ms_before": rtt_before, "rtt_ms_after": rtt_after, "loss_pct": loss_pct}
    report.notes.insert(0, f"across namespaces: link {rate or 'unlimited'} each way, one-way delay {delay_ms:.3f} ms "
                           f"(delay line), TCP round trip p50 {rtt_before['p50']} ms before / "
                           f"{rtt_after['p50'] if rtt_after else '-'} ms after (min {rtt_before['min']}), "
                           f"loss {loss_pct}% each way")
    report.emit(as_json)


def _link(rtt_ms: float, rate: str | None, loss_pct: float, log_dir: Path) -> tuple[Fabric, float, dict]:
    """The two-member fabric with the line's delay set so the measured round trip is about
    `rtt_ms` (the line adds its own time: up to two corrections)."""
    delay = rtt_ms / 2
    for attempt in range(3):
        net = Fabric(["client", "server"], delay_ms=delay, log_dir=log_dir).start()
        try:
            for member in ("client", "server"):
                net.shape(member, rate=rate, loss_pct=loss_pct)
            rtt = net.rtt_ms("client", "server", 200)
        except BaseException:
            net.close()
            raise
        log.info("link: one-way delay %.3f ms -> round trip %s ms", delay, rtt)
        if rtt_ms <= 0 or rtt["p50"] <= 1.1 * rtt_ms or attempt == 2:
            return net, delay, rtt
        net.close()
        delay = max(0.01, delay - (rtt["p50"] - rtt_ms) / 2)
    raise AssertionError("unreachable")


class RawPeer:
    """`probe.RawStore` as a bench system."""

    def __init__(self, host: str, port: int):
        self.name = "raw_tcp"
        self.store = probe.RawStore(host, port)

    def put(self, key: str, value: np.ndarray) -> None:
        self.store.put(key, memoryview(value))

    def get_into(self, key: str, out: np.ndarray) -> int:
        return self.store.get_into(key, memoryview(out))

    def get_batch_into(self, keys: list[str], outs: list[np.ndarray]) -> None:
        self.store.get_batch_into(keys, [memoryview(o) for o in outs])

    def remove(self, keys: list[str]) -> None:
        for key in keys:
            self.store.remove(key)

    def close(self) -> None:
        self.store.close()


def inside(net: Fabric, out: Path, sizes: list[int], per_rep: int, min_ops: int, reps: int, batch: int,
           no_put: bool, no_engine: bool, rate: str | None) -> None:
    """The bench proper, in "client": pool and raw store in "server", over the fabric's link."""
    from kvpool.tools.bench.pool import ENGINE, Ours, Workload, _run
    from kvpool.tools.bench.pool_process import auth_pool

    report = Report("pool")
    workloads = [Workload(s, max(min_ops, per_rep // s), batch) for s in sizes]
    working_set = sum(w.size * w.count for w in workloads)
    where = {"host": net.ip("server"), "prefix": net.exec_prefix("server")}
    server, credential, cleanup = auth_pool(max(1 << 30, 4 * working_set), principal="bench", **where)
    systems: list[Any] = []
    raw_server = None
    try:
        paths = [("ours_tcp", "rpc")] + ([] if no_engine else [(ENGINE, "engine")])
        for name, data_path in paths:
            systems.append(Ours(server.address, False, name, data_path, credential, server=server))
        raw_server, port = net.probe_server("server")
        systems.append(RawPeer(net.ip("server"), port))
        _run(report, systems, workloads, reps, no_put)
        streams = [gbps(STREAM_BYTES, probe.stream(net.ip("server"), port, STREAM_BYTES)) for _ in range(STREAM_REPS)]
    finally:
        for system in systems:
            system.close()
        stop(raw_server, 2.0)
        cleanup()
    link = rate_bits(rate) / 8e9 if rate else None
    report.add("stream_raw_tcp", streams, "GB/s", size=STREAM_BYTES, baseline="link_rate" if link else None,
               baseline_values=[link] if link else None)
    for r in report.results:
        if link and r.unit == "GB/s":
            r.extra["link_share"] = round(r.value / link, 3)
    report.setup = {"members": {m.name: m.ip for m in net.members.values()}, "rate": rate,
                    "link_GBps": link, "auth": "keyring, tenant client (protected mode off loopback)"}
    out.write_text(json.dumps(report.document()))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="the bench inside a fabric's client namespace (run_across starts it)")
    p.add_argument("--fabric", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--sizes", required=True)
    p.add_argument("--per-rep", type=int, required=True)
    p.add_argument("--min-ops", type=int, required=True)
    p.add_argument("--reps", type=int, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--rate", default="")
    p.add_argument("--no-put", action="store_true")
    p.add_argument("--no-engine", action="store_true")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    inside(Fabric.attach(a.fabric), a.out, [int(s) for s in a.sizes.split(",")], a.per_rep, a.min_ops, a.reps,
           a.batch, a.no_put, a.no_engine, a.rate or None)


if __name__ == "__main__":
    main(sys.argv[1:])
