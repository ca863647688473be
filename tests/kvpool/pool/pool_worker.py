"""A client process for the multi-process tests:
`python pool_worker.py ADDRESS put|get SEED COUNT [DATA_PATH]` (DATA_PATH: auto, rpc or engine;
engine moves the bytes through the transfer engine over tcp).

Chunks are generated from SEED (keys: 32 hex characters; values: 1..64 KiB of random bytes), so
another process can verify every byte without sharing memory. Exit 0 = all good; the last stdout
line is a JSON summary.
"""

from __future__ import annotations

import json
import sys

import numpy as np

import kvpool


def chunks(seed: int, count: int):
    rng = np.random.default_rng(seed)
    for i in range(count):
        size = int(rng.integers(1024, 64 * 1024))
        yield f"{seed:08x}{i:024x}", rng.integers(0, 256, size, dtype=np.uint8).tobytes()


def main() -> int:
    address, mode, seed, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    data_path = sys.argv[5] if len(sys.argv) > 5 else "auto"
    client = kvpool.connect(address, timeout=20, data_path=data_path, transports=("tcp",))
    if data_path != "auto":
        client.get_batch(["warm-up: connects every node"])
    bad, missing, done = 0, 0, 0
    try:
        items = list(chunks(seed, count))
        if mode == "put":
            for start in range(0, count, 50):
                errors = client.put_batch(items[start:start + 50])
                bad += sum(e is not None for e in errors)
            done = count - bad
        else:
            got = client.get_batch([k for k, _ in items[: count // 2]])
            got += [client.get(k) for k, _ in items[count // 2:]]
            for (key, value), back in zip(items, got):
                if back is None:
                    missing += 1
                elif back != value:
                    bad += 1
                else:
                    done += 1
        paths = sorted(set(client.data_paths().values()))
    finally:
        client.close()
    print(json.dumps({"mode": mode, "seed": seed, "ok": done, "bad": bad, "missing": missing, "paths": paths}))
    return 0 if bad == 0 and missing == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
