"""A transfer engine in its own process, for tests and benches: `python peer.py SIZE SEED TRANSPORTS`.

It registers two shared-memory segments: "pattern" (filled from numpy's generator with SEED,
so the test can compute every byte) and "scratch" (zeros), prints each descriptor as a hex
line on stdout, then serves until stdin closes.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from transfer import TransferEngine, create_shm_buffer


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


if __name__ == "__main__":
    main()
