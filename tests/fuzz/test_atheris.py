"""Coverage-guided fuzzing with atheris (issue 14): tests/fuzz/atheris_targets.py, each target in
a subprocess of its own, for `KVPOOL_ATHERIS_SECONDS` (default 60) in the `slow` suite; a smoke
run of every target in one process (`all`, ~100 inputs each) in the default suite. Both only
where atheris is installed (`pip install -e '.[fuzz]'`; `make test-slow` tries).

A crash (an exception a check does not allow) fails the test with libFuzzer's output, which holds
the traceback; the input is left in the test's tmp_path as crash-<sha1>.
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import atheris  # noqa: F401
except ImportError as exc:  # not installed, or installed without a loadable libFuzzer
    pytest.skip(f"atheris is not importable ({exc}); pip install -e '.[fuzz]' (make test-slow tries)",
                allow_module_level=True)

HARNESS = Path(__file__).with_name("atheris_targets.py")
SECONDS = int(os.environ.get("KVPOOL_ATHERIS_SECONDS", "60"))
TRIED = re.compile(r"^atheris (\S+): (\d+) inputs tried in ([\d.]+) s$", re.M)


def _names() -> list[str]:
    from atheris_targets import targets

    return sorted(targets())


def _rss_limit_flags() -> list[str]:
    """libFuzzer's memory limits, as if the harness started alone. Its RSS check reads the peak
    RSS (`ru_maxrss`), which Linux carries across fork and exec: a harness started by a pytest
    that grew to 4.4 GB (the slow suite, after its model tests) was "out of memory" at once with
    the default 2 GB limit. So the limit is this process's peak plus 2 GB, and a single
    allocation over 2 GB still counts as a finding."""
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    return [f"-rss_limit_mb={peak_mb + 2048}", "-malloc_limit_mb=2048"]


def _fuzz(target: str, flags: list[str], tmp_path: Path, timeout: float) -> dict[str, int]:
    """Run the harness; return inputs tried per target (asserting a clean exit)."""
    proc = subprocess.run([sys.executable, str(HARNESS), target, *flags, *_rss_limit_flags(),
                           f"-artifact_prefix={tmp_path}/"],
                          capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"atheris {target} exited {proc.returncode}:\n{out[-6000:]}"
    assert not list(tmp_path.glob("crash-*")), out[-6000:]
    return {name: int(n) for name, n, _ in TRIED.findall(out)}


def test_atheris_smoke_every_target(tmp_path):
    names = _names()
    tried = _fuzz("all", [f"-atheris_runs={100 * len(names)}", "-seed=1"], tmp_path, timeout=120)
    missed = [n for n in names if tried.get(n, 0) == 0]
    assert not missed, f"targets the smoke run never reached: {missed} (tried: {tried})"


@pytest.mark.slow
@pytest.mark.parametrize("target", _names())
def test_atheris_long(target, tmp_path):
    tried = _fuzz(target, [f"-max_total_time={SECONDS}"], tmp_path, timeout=SECONDS * 3 + 120)
    assert tried.get(target, 0) > 0, f"atheris {target} reported no inputs: {tried}"
