from __future__ import annotations

from pathlib import Path

import pytest

_RELATIVE = Path("data") / "traces" / "conversation_trace.jsonl"
# The shared folder next to this checkout, or the one the project's machines have (a clone
# elsewhere, as CI makes, still finds it).
CANDIDATES = (Path(__file__).resolve().parents[5] / "shared" / _RELATIVE, Path("/work/shared") / _RELATIVE)
TRACE = next((p for p in CANDIDATES if p.is_file()), CANDIDATES[0])


@pytest.fixture(scope="session")
def trace_path() -> Path:
    if not TRACE.is_file():
        pytest.skip(f"the Mooncake conversation trace is not at {' or '.join(map(str, CANDIDATES))}")
    return TRACE
