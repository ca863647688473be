"""The SSD tier after a real kill -9 mid-write, and after on-disk damage: intact or absent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import lmdb

from kvpool.tiers import SsdTier
from kvpool.tiers.ssd import _lmdb_key

WRITER = r"""
import hashlib, sys
from kvpool.tiers import SsdTier

def value(key, size):
    seed = hashlib.sha256(f"{key}/{size}".encode()).digest()
    return (seed * (size // 32 + 1))[:size]

tier = SsdTier(sys.argv[1], 64 << 20)
start = int(sys.argv[2])
for i in range(start, start + 100000):
    key = f"obj{i}"
    size = 1000 + (i * 7919) % 300000
    try:
        tier.put(key, value(key, size))
    except Exception:  # full: drop the oldest we wrote and keep going
        tier.remove(f"obj{i - 150}")
    if i - start == 40:
        print("ready", flush=True)
"""


def _value(key: str, size: int) -> bytes:
    import hashlib

    seed = hashlib.sha256(f"{key}/{size}".encode()).digest()
    return (seed * (size // 32 + 1))[:size]


def test_kill_9_mid_write_leaves_objects_intact_or_absent(tmp_path):
    path = str(tmp_path / "ssd")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    seen = 0
    for round_ in range(3):
        child = subprocess.Popen([sys.executable, "-c", WRITER, path, str(round_ * 100000)],
                                 stdout=subprocess.PIPE, text=True, env=env)
        try:
            assert child.stdout.readline().strip() == "ready"
            time.sleep(0.05 + 0.1 * round_)  # land the kill at different points of a write
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
            child.stdout.close()
        assert child.returncode == -signal.SIGKILL
        tier = SsdTier(path, 64 << 20)
        try:
            keys = list(tier.keys())
            assert len(keys) >= 40
            for key, size in keys:
                got = tier.get(key)
                assert got is None or got == _value(key, size), f"{key} came back damaged"
                seen += got is not None
            assert tier.used <= tier.capacity
        finally:
            tier.close()
    assert seen >= 120


def test_damaged_payload_reads_as_absent(tmp_path):
    path = str(tmp_path / "ssd")
    tier = SsdTier(path, 1 << 20)
    tier.put("a", b"x" * 5000)
    tier.put("b", b"y" * 5000)
    # Flip bytes of a's payload behind the tier's back, keeping its length.
    with tier.env.begin(write=True) as txn:
        txn.put(_lmdb_key("a"), b"z" * 5000, db=tier._data)
    assert tier.get("a") is None
    assert not tier.contains("a")
    assert tier.get("b") == b"y" * 5000
    # A truncated payload is dropped when the environment is reopened.
    with tier.env.begin(write=True) as txn:
        txn.put(_lmdb_key("b"), b"y" * 100, db=tier._data)
    tier.close()
    tier = SsdTier(path, 1 << 20)
    assert list(tier.keys()) == [] and tier.used == 0
    tier.close()
    env = lmdb.open(path, max_dbs=2)
    with env.begin() as txn:
        assert txn.get(_lmdb_key("b"), db=env.open_db(b"data", txn=txn)) is None
    env.close()
