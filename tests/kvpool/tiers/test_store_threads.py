"""Many threads on one TieredStore under DRAM and SSD pressure: no torn or foreign bytes, no
leaked pins, reservations or space, and every stored object is reported removed exactly once."""

from __future__ import annotations

import collections
import hashlib
import random
import threading
import time

import pytest

from kvpool.errors import AllPinned, AlreadyExists, CapacityError, KeyNotFound
from kvpool.tiers import TieredStore


def _value(key: str) -> bytes:
    size = 5_000 + int(key[1:]) * 3997  # 5 KB .. 320 KB: both the locked and the pinned copy paths
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (size // 32 + 1))[:size]


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "arc"])
def test_concurrent_put_reserve_get_pin_remove(tmp_path, policy):
    store = TieredStore(400 * 1024, ssd_path=str(tmp_path / "ssd"), ssd_capacity=1 << 20, policy=policy)
    events: collections.Counter = collections.Counter()
    lock = threading.Lock()

    def on_event(key: str, event: str) -> None:
        with lock:
            events[event] += 1

    store.on_event = on_event
    errors: list[BaseException] = []
    stop = time.monotonic() + 1.5

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        buf = bytearray(400_000)
        try:
            while time.monotonic() < stop:
                key = f"k{rng.randrange(80)}"
                action = rng.random()
                try:
                    if action < 0.3:
                        store.put(key, _value(key))
                    elif action < 0.45:
                        res = store.reserve(key, len(_value(key)))
                        store.arena.buffer[res.offset : res.offset + res.length] = _value(key)
                        store.abort(key) if rng.random() < 0.2 else store.commit(key)
                    elif action < 0.7:
                        n = store.get_into(key, buf)
                        assert bytes(buf[:n]) == _value(key), "torn or foreign bytes"
                    elif action < 0.85:
                        with store.pinned(key) as loc:
                            time.sleep(0.0002)  # hold the pin while others evict
                            got = bytes(store.arena.buffer[loc.offset : loc.offset + loc.length])
                            assert got == _value(key), "pinned bytes changed"
                    elif action < 0.9:
                        got = store.get(key)
                        assert got is None or got == _value(key)
                    else:
                        store.remove(key)
                except (KeyNotFound, AllPinned, CapacityError, AlreadyExists):
                    pass
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors, errors[0]
        stats = store.stats()
        assert stats["total"]["pinned"] == 0
        for tier in stats["tiers"].values():
            assert tier["used"] <= tier["capacity"]
        assert stats["total"]["hits"] > 50 and events["demoted"] > 0 and events["promoted"] > 0
        for key, _, _ in list(store.keys()):
            store.remove(key)
        stats = store.stats()
        assert stats["tiers"]["dram"]["used"] == 0, "leaked DRAM space (a reservation or a pin)"
        assert stats["tiers"]["ssd"]["used"] == 0
        assert events["stored"] == events["removed"], events
    finally:
        store.close()
