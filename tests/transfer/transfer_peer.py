"""A transfer engine in its own process, for tests: `python transfer_peer.py SIZE SEED TRANSPORTS`.

It registers two shared-memory segments: "pattern" (filled from numpy's generator with SEED,
so the test can compute every byte) and "scratch" (zeros), prints each descriptor as a hex
line on stdout, then serves until stdin closes. `Peer` starts one and cleans up after it
(even after SIGKILL).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from transfer import SegmentDescriptor, TransferEngine, create_shm_buffer


def pattern(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def main() -> None:
    size, seed = int(sys.argv[1]), int(sys.argv[2])
    transports = sys.argv[3].split(",") if len(sys.argv) > 3 else ["shm", "tcp"]
    engine = TransferEngine(name=f"peer-{os.getpid()}", transports=transports, timeout=5.0).start()
    paths = []
    try:
        for name in ("pattern", "scratch"):
            mapping, path = create_shm_buffer(size)
            paths.append(path)
            if name == "pattern":
                np.frombuffer(mapping, dtype=np.uint8)[:] = pattern(size, seed)
            desc = engine.register(mapping, name=name, shm_path=path)
            sys.stdout.write(desc.to_bytes().hex() + "\n")
        sys.stdout.flush()
        sys.stdin.read()  # serve until the parent closes our stdin
    finally:
        engine.close()
        for path in paths:
            os.unlink(path)


PEER_SCRIPT = Path(__file__)
REPO = Path(__file__).resolve().parents[2]


class Peer:
    """A `transfer_peer.py` process: `pattern` and `scratch` segments of `size` bytes."""

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



if __name__ == "__main__":
    main()
