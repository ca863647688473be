"""`make gpu-check` (`python -m kvpool.tools.bench.gpu_check`): use a briefly lent CUDA machine well.

In one run of a few minutes it measures the copies a GPU engine makes when it loads KV from the
pool or saves KV to it: the node's shared-memory DRAM arena to and from the device, registered
with `cudaHostRegister` (what pinning the arena buys) and plain, against page-locked host memory
(the ceiling), 64 KiB .. 64 MiB. Then it runs the test suites marked `cuda`. It prints the
BENCH.md JSON object on its last line. Without CUDA it says why and exits 0. `--device cpu` runs
the same code on the CPU, to check the script itself on any machine.
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


def cuda_unavailable_reason() -> str | None:
    """None where torch sees a usable CUDA device, else why not."""
    try:
        import torch
    except ImportError as exc:
        return f"torch is not importable ({exc})"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is false"
    return None


def run_cuda_tests() -> int:
    tests = Path(__file__).resolve().parents[3] / "tests"
    if not tests.exists():
        print(f"tests not found at {tests}; skipped", file=sys.stderr)
        return 0
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests), "-m", "cuda"]
    print("$", " ".join(cmd), file=sys.stderr, flush=True)
    rc = subprocess.run(cmd, cwd=tests.parent, stdout=sys.stderr, stderr=sys.stderr).returncode
    return 0 if rc == 5 else rc  # 5: no test carries the marker


def bench_copies(report: Report, device_name: str, sizes: tuple[int, ...], per_figure: int, reps: int) -> None:
    import numpy as np
    import torch

    from kvpool.shm.arena import SharedArena

    device = torch.device(device_name)
    biggest = max(sizes)
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

            def timed_loop(fn) -> float:
                _sync(device)
                start = time.perf_counter()
                for _ in range(iters):
                    fn()
                _sync(device)
                return gbps(iters * size, time.perf_counter() - start)

            def torch_h2d(src_t):
                return lambda: timed_loop(lambda: dev_t[:size].copy_(src_t[:size], non_blocking=True))

            def torch_d2h(dst_t):
                return lambda: timed_loop(lambda: dst_t[:size].copy_(dev_t[:size], non_blocking=True))

            pinned_h2d, pinned_d2h = torch_h2d(pinned_t), torch_d2h(pinned_t)
            ours, base = alternate(pinned_h2d, torch_h2d(arena_t), reps=reps)
            report.add("torch_h2d_pinned", ours, "GB/s", size=size, baseline="torch_h2d_shm_arena", baseline_values=base,
                       extra={"arena_registered": registered})
            ours, base = alternate(pinned_d2h, torch_d2h(arena_t), reps=reps)
            report.add("torch_d2h_pinned", ours, "GB/s", size=size, baseline="torch_d2h_shm_arena", baseline_values=base,
                       extra={"arena_registered": registered})
            dev_t[:size].copy_(arena_t[:size])
            _sync(device)
            assert bool((dev_t[:size].cpu() == host_t[:size]).all()), "arena -> device copy read back wrong bytes"
    finally:
        if registered:
            torch.cuda.cudart().cudaHostUnregister(arena_t.data_ptr())
        del arena_t
        arena.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu to check the script itself")
    parser.add_argument("--quick", action="store_true", help="small sizes and few repetitions")
    parser.add_argument("--no-tests", action="store_true", help="skip the tests marked cuda")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    if args.device.startswith("cuda"):
        reason = cuda_unavailable_reason()
        if reason is not None:
            print(f"gpu-check skipped: {reason}")
            return 0
    rc = 0 if args.no_tests else run_cuda_tests()
    import torch

    report = Report("gpu")
    if args.device.startswith("cuda"):
        report.notes.append(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, cuda {torch.version.cuda}")
    sizes = SIZES[:2] if args.quick else SIZES
    bench_copies(report, args.device, sizes, per_figure=(8 << 20) if args.quick else (1 << 30),
                 reps=2 if args.quick else 5)
    if rc != 0:
        report.notes.append(f"the tests marked cuda FAILED (pytest exit {rc})")
    report.emit(as_json=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
