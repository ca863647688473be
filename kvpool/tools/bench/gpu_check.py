"""`make gpu-check` (`python -m kvpool.tools.bench.gpu_check`): use a briefly lent CUDA machine well.

In one run of a few minutes it
1. runs the HBM tier's conformance tests (tests/kvpool/tiers/test_conformance.py -k hbm), and
2. measures host<->device chunk copies through `HbmTier` (put = host->device, get_into =
   device->host) for 64 KiB .. 64 MiB objects against `torch` copy ceilings measured the same
   way in the same run: a plain `Tensor.copy_` between the same pageable host memory and the
   device, and the same copy from page-locked (pinned) host memory; plus the shared-memory DRAM
   arena registered with `cudaHostRegister`, to show what pinning the arena would buy.
It prints the BENCH.md JSON object on its last line. Without CUDA it says why and exits 0.
`--device cpu` runs the same code on the CPU, to check the script itself on any machine.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import time
from pathlib import Path

from kvpool.tools.bench.report import Report, alternate, gbps

log = logging.getLogger("kvpool.gpu_check")

SIZES = (64 << 10, 1 << 20, 8 << 20, 64 << 20)


def _sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def run_conformance() -> int:
    tests = Path(__file__).resolve().parents[3] / "tests" / "kvpool" / "tiers" / "test_conformance.py"
    if not tests.exists():
        print(f"conformance tests not found at {tests}; skipped", file=sys.stderr)
        return 0
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests), "-k", "hbm", "-m", "not slow"]
    print("$", " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd, cwd=tests.parents[3], stdout=sys.stderr, stderr=sys.stderr).returncode


def bench_copies(report: Report, device_name: str, sizes: tuple[int, ...], per_figure: int, reps: int) -> None:
    import numpy as np
    import torch

    from kvpool.shm.arena import SharedArena
    from kvpool.tiers import HbmTier

    device = torch.device(device_name)
    biggest = max(sizes)
    tier = HbmTier(2 * biggest + (1 << 20), device=device_name)
    host = np.random.default_rng(0).integers(0, 256, biggest, dtype=np.uint8)
    host_t = torch.from_numpy(host)
    pinned_t = host_t.pin_memory() if device.type == "cuda" else host_t.clone()
    dev_t = torch.empty(biggest, dtype=torch.uint8, device=device)
    arena = SharedArena.create(biggest)
    arena_t = torch.frombuffer(arena.buffer, dtype=torch.uint8)
    arena_t.copy_(host_t)
    registered = False
    if device.type == "cuda":
        err = torch.cuda.cudart().cudaHostRegister(arena_t.data_ptr(), biggest, 0)
        registered = int(err) == 0
        if not registered:
            report.notes.append(f"cudaHostRegister of the shm arena failed ({err}); arena figures are pageable")
    try:
        for size in sizes:
            iters = max(4, per_figure // size)
            src = memoryview(host)[:size]
            out = np.empty(size, dtype=np.uint8)

            def timed_loop(fn) -> float:
                _sync(device)
                start = time.perf_counter()
                for _ in range(iters):
                    fn()
                _sync(device)
                return gbps(iters * size, time.perf_counter() - start)

            def tier_put() -> float:
                def once():
                    tier.remove("obj")
                    tier.put("obj", src)
                return timed_loop(once)

            def tier_get() -> float:
                return timed_loop(lambda: tier.get_into("obj", out))

            def torch_h2d(src_t):
                return lambda: timed_loop(lambda: dev_t[:size].copy_(src_t[:size], non_blocking=True))

            def torch_d2h(dst_t):
                return lambda: timed_loop(lambda: dst_t[:size].copy_(dev_t[:size], non_blocking=True))

            ours, base = alternate(tier_put, torch_h2d(host_t), reps=reps)
            report.add("hbm_put_h2d", ours, "GB/s", size=size, baseline="torch_copy_pageable", baseline_values=base)
            tier.put("obj", src)
            ours, base = alternate(tier_get, torch_d2h(torch.from_numpy(out)), reps=reps)
            report.add("hbm_get_into_d2h", ours, "GB/s", size=size, baseline="torch_copy_pageable", baseline_values=base)
            assert bytes(out) == bytes(src), "HBM tier read back wrong bytes"
            pinned_h2d, pinned_d2h = torch_h2d(pinned_t), torch_d2h(pinned_t)
            ours, base = alternate(pinned_h2d, torch_h2d(arena_t), reps=reps)
            report.add("torch_h2d_pinned", ours, "GB/s", size=size, baseline="torch_h2d_shm_arena", baseline_values=base,
                       extra={"arena_registered": registered})
            ours, base = alternate(pinned_d2h, torch_d2h(arena_t), reps=reps)
            report.add("torch_d2h_pinned", ours, "GB/s", size=size, baseline="torch_d2h_shm_arena", baseline_values=base,
                       extra={"arena_registered": registered})
    finally:
        if registered:
            torch.cuda.cudart().cudaHostUnregister(arena_t.data_ptr())
        del arena_t
        arena.close()
        tier.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu to check the script itself")
    parser.add_argument("--quick", action="store_true", help="small sizes and few repetitions")
    parser.add_argument("--no-tests", action="store_true", help="skip the conformance tests")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    if args.device.startswith("cuda"):
        from kvpool.tiers.hbm import cuda_unavailable_reason

        reason = cuda_unavailable_reason()
        if reason is not None:
            print(f"gpu-check skipped: {reason}")
            return 0
    rc = 0 if args.no_tests else run_conformance()
    import torch

    report = Report("gpu")
    if args.device.startswith("cuda"):
        report.notes.append(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, cuda {torch.version.cuda}")
    sizes = SIZES[:2] if args.quick else SIZES
    bench_copies(report, args.device, sizes, per_figure=(8 << 20) if args.quick else (1 << 30),
                 reps=2 if args.quick else 5)
    if rc != 0:
        report.notes.append(f"HBM conformance tests FAILED (pytest exit {rc})")
    report.emit(as_json=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
