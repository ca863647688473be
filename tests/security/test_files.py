"""Files a node leaves on disk hold users' prompts in another form: the SSD tier's directory is
0700 and its files 0600; shared-memory files (the DRAM arena, the shm index, transfer buffers)
are 0600. Checked with os.stat on the real files, with a permissive umask so a default of the
process cannot hide a wrong mode."""

from __future__ import annotations

import os
import stat

import pytest

from kvpool.shm.arena import SharedArena
from kvpool.shm.index import ShmIndex
from kvpool.tiers.ssd import SsdTier
from transfer.shm import create_shm_buffer


@pytest.fixture()
def open_umask():
    old = os.umask(0o000)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_ssd_tier_directory_0700_files_0600(tmp_path, open_umask):
    path = str(tmp_path / "ssd")
    tier = SsdTier(path, 1 << 20)
    try:
        tier.put("k" * 8, memoryview(b"x" * 4096))
        assert mode(path) == 0o700
        names = sorted(os.listdir(path))
        assert {"data.mdb", "lock.mdb"} <= set(names)
        for name in names:
            assert mode(os.path.join(path, name)) == 0o600, name
    finally:
        tier.close()


def test_ssd_tier_tightens_what_an_older_version_left_open(tmp_path, open_umask):
    path = str(tmp_path / "ssd")
    SsdTier(path, 1 << 20).close()
    os.chmod(path, 0o755)
    for name in os.listdir(path):
        os.chmod(os.path.join(path, name), 0o644)
    tier = SsdTier(path, 1 << 20)
    try:
        assert mode(path) == 0o700
        assert all(mode(os.path.join(path, n)) == 0o600 for n in os.listdir(path))
    finally:
        tier.close()


def test_shared_memory_files_0600(tmp_path, open_umask):
    arena = SharedArena.create(1 << 20, prefault=False)
    try:
        assert mode(arena.path) == 0o600
    finally:
        arena.close()
    index = ShmIndex(str(tmp_path / "index"), 64)
    try:
        assert mode(index.path) == 0o600
    finally:
        index.close()
    mapping, path = create_shm_buffer(4096)
    try:
        assert mode(path) == 0o600
    finally:
        mapping.close()
        os.unlink(path)
