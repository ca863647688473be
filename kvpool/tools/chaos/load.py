"""One load client of a chaos campaign, in its own process: a steady put/get/match_prefix/remove
mix through the pool SDK, every operation written as one JSON line with its result.

    python -m kvpool.tools.chaos.load --address etcd://127.0.0.1:P --client 3 --seed 7 --out ops-3.jsonl

Keys are `c<client>-<n>` (each client owns its keys, so each key's history is one process's
sequence of operations); values come from `kvpool.tools.chaos.values`. A record:
{"t0", "t1" (wall clock), "op": put|get|absent|removed|match|remove, "key", "res": ok|miss|err|wrong|
bad, ...}: `absent` reads a key never put, `removed` a key whose remove was acknowledged, `match`
asks match_prefix of [3 live keys, a key never put, a live key] (more than 3 is a wrong answer).
After an acknowledged put the client asks the master where the replicas are (`nodes`), so the
checker can tell a loss that came with its nodes from one that did not.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import signal
import sys
import time
from collections import deque

import kvpool
from kvpool.tools.chaos.values import value_of, whose
from kvpool.errors import KVPoolError

log = logging.getLogger(__name__)


class Load:
    def __init__(self, address: str, client: int, seed: int, out, live_max: int, rate: float, timeout: float):
        self.address, self.client, self.rng = address, client, random.Random(seed)
        self.out, self.live_max, self.period, self.timeout = out, live_max, 1.0 / rate, timeout
        self.live: deque[str] = deque()
        self.removed: deque[str] = deque(maxlen=500)
        self.n = 0
        self.pool = None
        self.stopping = False

    def record(self, **rec) -> None:
        self.out.write(json.dumps(rec, separators=(",", ":")) + "\n")

    def connect(self) -> None:
        while self.pool is None and not self.stopping:
            t0 = time.time()
            try:
                self.pool = kvpool.connect(self.address, timeout=self.timeout, use_shm=False)
            except KVPoolError as exc:
                self.record(t0=t0, t1=time.time(), op="connect", res="err", err=_name(exc))
                time.sleep(0.2)

    def run(self, until: float) -> None:
        self.connect()
        while not self.stopping and time.time() < until:
            started = time.monotonic()
            try:
                self.step()
            except KVPoolError:
                pass  # recorded by step
            except Exception as exc:  # not a typed error: the SDK broke its contract; keep going
                self.record(t0=time.time(), t1=time.time(), op="crash", res="bad", err=repr(exc)[:300])
            self.out.flush()
            time.sleep(max(0.0, self.period - (time.monotonic() - started)))
        if self.pool is not None:
            self.pool.close()

    def step(self) -> None:
        if len(self.live) > self.live_max:
            return self.remove(self.live.popleft())
        r = self.rng.random()
        if r < 0.35 or len(self.live) < 5:
            return self.put()
        if r < 0.75:
            return self.get("get", self.rng.choice(self.live))
        if r < 0.85:
            return self.match()
        if r < 0.92:
            return self.remove(self.live.pop() if self.rng.random() < 0.2 else self.live.popleft())
        if r < 0.96 and self.removed:
            return self.get("removed", self.rng.choice(self.removed))
        return self.get("absent", f"c{self.client}-never-{self.rng.randrange(1 << 30)}")

    def put(self) -> None:
        key = f"c{self.client}-{self.n}"
        self.n += 1
        rep = self.rng.choice((1, 2))
        t0 = time.time()
        try:
            self.pool.put(key, value_of(key), replicas=rep)
        except KVPoolError as exc:
            self.record(t0=t0, t1=time.time(), op="put", key=key, rep=rep, res="err", err=_name(exc))
            return
        t1 = time.time()
        try:
            nodes = sorted(r["node_id"] for r in self.pool.admin("key_info", key=key)["replicas"])
        except KVPoolError:
            nodes = None  # unknown: the checker treats it leniently
        self.record(t0=t0, t1=t1, op="put", key=key, rep=rep, res="ok", nodes=nodes)
        self.live.append(key)

    def get(self, op: str, key: str) -> None:
        t0 = time.time()
        try:
            data = self.pool.get(key)
        except KVPoolError as exc:
            self.record(t0=t0, t1=time.time(), op=op, key=key, res="err", err=_name(exc))
            return
        t1 = time.time()
        if data is None:
            self.record(t0=t0, t1=t1, op=op, key=key, res="miss")
        elif data == value_of(key):
            self.record(t0=t0, t1=t1, op=op, key=key, res="ok")
        else:
            self.record(t0=t0, t1=t1, op=op, key=key, res="wrong", size=len(data), names=whose(data))

    def match(self) -> None:
        keys = self.rng.sample(list(self.live), 3) if len(self.live) >= 4 else list(self.live)[:3]
        never = f"c{self.client}-never-{self.rng.randrange(1 << 30)}"
        keys = keys + [never, self.rng.choice(self.live)]
        t0 = time.time()
        try:
            n = self.pool.match_prefix(keys)
        except KVPoolError as exc:
            self.record(t0=t0, t1=time.time(), op="match", keys=keys, res="err", err=_name(exc))
            return
        self.record(t0=t0, t1=time.time(), op="match", keys=keys, n=n, res="ok" if n <= keys.index(never) else "wrong")

    def remove(self, key: str) -> None:
        t0 = time.time()
        try:
            found = self.pool.remove(key)
        except KVPoolError as exc:
            self.record(t0=t0, t1=time.time(), op="remove", key=key, res="err", err=_name(exc))
            return
        self.record(t0=t0, t1=time.time(), op="remove", key=key, res="ok" if found else "miss")
        self.removed.append(key)


def _name(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:160]}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--address", required=True)
    p.add_argument("--client", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--duration", type=float, default=3600.0)
    p.add_argument("--live-max", type=int, default=250)
    p.add_argument("--rate", type=float, default=25.0, help="operations per second")
    p.add_argument("--timeout", type=float, default=5.0, help="the SDK's timeout per call")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with open(a.out, "a", buffering=1 << 16) as out:
        load = Load(a.address, a.client, a.seed, out, a.live_max, a.rate, a.timeout)

        def stop(*_: object) -> None:
            load.stopping = True

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        load.run(time.time() + a.duration)


if __name__ == "__main__":
    main(sys.argv[1:])
