from __future__ import annotations

from pathlib import Path

import pytest

TRACE = Path(__file__).resolve().parents[4] / "shared" / "data" / "traces" / "conversation_trace.jsonl"


@pytest.fixture(scope="session")
def trace_path() -> Path:
    if not TRACE.is_file():
        pytest.skip(f"the Mooncake conversation trace is not at {TRACE}")
    return TRACE
