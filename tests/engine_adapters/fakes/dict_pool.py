"""FAKE in-process pool for the connector tests: a dict behind the PoolClient contract.

`DictPoolForConnectorTests` satisfies `kvpool.contract.PoolClient` with a plain dict and nothing
else: no tiers, no network. It exists so the vLLM / SGLang adapter tests can run before (or
without) the real pool; where `kvpool.embedded.EmbeddedPool` is available the tests use that.
It keeps the contract's invariants: first complete put wins, batch forms answer per key.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

from kvpool.contract import check_key
from kvpool.errors import InvalidArgument, KeyNotFound


def _to_bytes(value: Any) -> bytes:
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # a torch tensor (bfloat16 included)
        import torch

        value = value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
    try:
        return memoryview(value).cast("B").tobytes()
    except TypeError:
        raise InvalidArgument(f"value of type {type(value).__name__} is not bytes-like") from None


class DictPoolForConnectorTests:
    """FAKE PoolClient backed by a dict (tests only; see the module docstring)."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self.calls: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def put(self, key: str, value: Any, *, replicas: int | None = None) -> None:
        self._count("put")
        data = _to_bytes(value)
        with self._lock:
            self._data.setdefault(check_key(key), data)

    put_from = put

    def get(self, key: str) -> bytes | None:
        self._count("get")
        return self._data.get(check_key(key))

    def get_into(self, key: str, buffer: Any) -> int:
        data = self.get(key)
        if data is None:
            raise KeyNotFound(key)
        view = memoryview(buffer).cast("B")
        if view.nbytes < len(data):
            raise InvalidArgument(f"buffer of {view.nbytes} bytes is too small for {len(data)}")
        view[: len(data)] = data
        return len(data)

    def exists(self, key: str) -> bool:
        return check_key(key) in self._data

    def remove(self, key: str) -> bool:
        with self._lock:
            return self._data.pop(check_key(key), None) is not None

    def match_prefix(self, keys: Sequence[str]) -> int:
        self._count("match_prefix")
        n = 0
        for key in keys:
            if check_key(key) not in self._data:
                break
            n += 1
        return n

    def put_batch(self, items: Sequence[tuple[str, Any]], *, replicas: int | None = None) -> list[Exception | None]:
        self._count("put_batch")
        out: list[Exception | None] = []
        for key, value in items:
            try:
                data = _to_bytes(value)
                with self._lock:
                    self._data.setdefault(check_key(key), data)
                out.append(None)
            except Exception as exc:  # per-key result, as the contract says
                out.append(exc)
        return out

    def get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        self._count("get_batch")
        return [self._data.get(key) if isinstance(key, str) else None for key in keys]

    def get_batch_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        out = []
        for key, buf in zip(keys, buffers):
            data = self._data.get(key) if isinstance(key, str) else None
            if data is None:
                out.append(-1)
                continue
            view = memoryview(buf).cast("B")
            if len(view) < len(data):
                raise InvalidArgument(f"buffer holds {len(view)} bytes, {key!r} needs {len(data)}")
            view[:len(data)] = data
            out.append(len(data))
        return out

    def exists_batch(self, keys: Sequence[str]) -> list[bool]:
        return [isinstance(key, str) and key in self._data for key in keys]

    def remove_batch(self, keys: Sequence[str]) -> list[bool]:
        return [self.remove(key) for key in keys]

    def close(self) -> None:
        pass

    # test helpers
    def keys(self) -> list[str]:
        return list(self._data)
