"""The SSD tier on a disk that fills up (found by the chaos campaign, issue 14): a node whose
SSD filesystem ran out of space died of SIGBUS, because lmdb wrote through a shared mapping
(writemap) of a sparse file. A full disk must cost the objects that did not fit, never the node.

Runs on a real tmpfs of 4 MiB (mounting needs root; skipped otherwise), in a child process so a
SIGBUS is a failed assertion rather than a dead test run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHILD = r"""
import sys
from kvpool.errors import CapacityError, InvalidArgument
from kvpool.tiers import SsdTier
from kvpool.tiers.store import TieredStore

path = sys.argv[1]
# The SSD tier believes it has 32 MiB; the filesystem under it has 4 MiB.
store = TieredStore(1 << 20, ssd_path=path + "/store", ssd_capacity=32 << 20, policy="lru")
blob = lambda i: bytes([i % 251]) * (64 << 10)
for i in range(160):  # 10 MiB through a 1 MiB DRAM tier: demotions fill the disk
    store.put(f"k{i}", blob(i))
assert store.get("k159") == blob(159), "the newest object (in DRAM) must be there"
got = [store.get(f"k{i}") for i in range(160)]  # hits on the SSD promote, and demote others
assert all(g is None or g == blob(i) for i, g in enumerate(got)), "a read returned other bytes"
kept = sum(g is not None for g in got)
assert 16 <= kept < 160, kept
store.close()

try:  # opening a tier on the full disk: a clear error, not SIGBUS (lmdb maps its lock file)
    SsdTier(path + "/full", 32 << 20).close()
except InvalidArgument as exc:
    assert "No space left" in str(exc), exc
import shutil

shutil.rmtree(path + "/store")
tier = SsdTier(path + "/tier", 32 << 20)
stored = 0
for i in range(100):
    try:
        tier.put(f"t{i}", blob(i))
        stored += 1
    except CapacityError:
        pass
assert 0 < stored < 100, stored
assert all(tier.get(f"t{i}") in (None, blob(i)) for i in range(100))
print("kept", kept, "stored", stored)
"""


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_full_disk_drops_objects_and_the_process_survives(small_disk):
    r = subprocess.run([sys.executable, "-c", CHILD, str(small_disk)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"exit {r.returncode} (-7 is SIGBUS)\n{r.stdout}\n{r.stderr[-3000:]}"
