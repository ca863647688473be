"""Many threads on one TieredStore: no torn or foreign bytes, no leaked pins or space."""

from __future__ import annotations

import hashlib
import random
import threading
import time

from kvpool.errors import AllPinned, AlreadyExists, CapacityError, KeyNotFound
from kvpool.tiers import TieredStore


def _value(key: str) -> bytes:
    size = 20_000 + int(key[1:]) * 997
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (size // 32 + 1))[:size]


def test_concurrent_put_get_pin_remove(tmp_path):
    store = TieredStore(512 * 1024, ssd_path=str(tmp_path / "ssd"), ssd_capacity=2 << 20, policy="s3fifo")
    errors: list[BaseException] = []
    stop = time.monotonic() + 2.0

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        buf = bytearray(200_000)
        try:
            while time.monotonic() < stop:
                key = f"k{rng.randrange(40)}"
                action = rng.random()
                try:
                    if action < 0.35:
                        store.put(key, _value(key))
                    elif action < 0.7:
                        n = store.get_into(key, buf)
                        assert bytes(buf[:n]) == _value(key), "torn or foreign bytes"
                    elif action < 0.9:
                        with store.pinned(key) as loc:
                            got = bytes(store.arena.buffer[loc.offset : loc.offset + loc.length])
                            assert got == _value(key), "pinned bytes changed"
                    else:
                        store.remove(key)
                except (KeyNotFound, AllPinned, CapacityError, AlreadyExists):
                    pass
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
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
        assert stats["total"]["hits"] > 50
        for key, _, _ in list(store.keys()):
            store.remove(key)
        assert store.stats()["tiers"]["dram"]["used"] == 0
        assert store.stats()["tiers"]["ssd"]["used"] == 0
    finally:
        store.close()
