"""Fixtures for the transfer tests: peer engines in their own processes, cleaned up always."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from transfer import SegmentDescriptor

PEER_SCRIPT = Path(__file__).with_name("peer.py")
REPO = Path(__file__).resolve().parents[2]


class Peer:
    """A `peer.py` process: `pattern` and `scratch` segments of `size` bytes."""

    def __init__(self, size: int, seed: int, transports: str):
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.proc = subprocess.Popen([sys.executable, str(PEER_SCRIPT), str(size), str(seed), transports],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        lines = [self.proc.stdout.readline() for _ in range(2)]
        if not all(lines):
            self.proc.kill()
            raise RuntimeError("peer process did not start")
        self.pattern_seg, self.scratch_seg = (SegmentDescriptor.from_bytes(bytes.fromhex(line.decode()))
                                              for line in lines)
        self.size, self.seed = size, seed

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGCONT)
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (subprocess.TimeoutExpired, OSError):
                self.proc.kill()
                self.proc.wait()
        for seg in (self.pattern_seg, self.scratch_seg):
            if seg.shm_path and os.path.exists(seg.shm_path):
                os.unlink(seg.shm_path)  # a killed peer cannot clean up after itself
        self.proc.stdout.close()


@pytest.fixture
def make_peer():
    peers: list[Peer] = []

    def start(size: int = 8 << 20, seed: int = 1, transports: str = "shm,tcp") -> Peer:
        peer = Peer(size, seed, transports)
        peers.append(peer)
        return peer

    yield start
    for peer in peers:
        peer.stop()
