"""KVHandle: a versioned wire type whose fields must agree with each other."""

from __future__ import annotations

import pytest

from engine_adapters.base import KVEvent
from kvpool.handle import KVHandle
from kvpool.errors import InvalidArgument

NS = "ab" * 16


def _handle(**kw) -> KVHandle:
    fields = dict(namespace=NS, request_id="r", num_tokens=37, chunk_tokens=16, chunk_keys=["0" * 32, "1" * 32],
                  tail_key="tail/r", token_ids=list(range(37)))
    fields.update(kw)
    return KVHandle(**fields)


def test_json_roundtrip():
    h = _handle()
    assert KVHandle.from_json(h.to_json()) == h
    assert h.tail_tokens == 5


@pytest.mark.parametrize("change", [
    dict(version=2),
    dict(namespace="abc"),
    dict(chunk_keys=["0" * 32]),  # 37 tokens need 2 full chunks
    dict(tail_key=None),  # ... and a 5-token tail
    dict(num_tokens=32),  # 2 full chunks and no tail, but a tail key is given
    dict(token_ids=[1, 2, 3]),
    dict(chunk_tokens=0),
])
def test_inconsistent_handles_are_rejected(change):
    with pytest.raises(InvalidArgument):
        KVHandle.from_json(_handle(**change).to_json())


@pytest.mark.parametrize("wire", [b"", b"[]", b'{"namespace": 3}', b"\xff\xfe", b'{"version": 1, "namespace": "x"}'])
def test_malformed_wire_is_invalid_argument(wire):
    with pytest.raises(InvalidArgument):
        KVHandle.from_json(wire)


def test_event_is_a_declared_type():
    import msgspec

    ev = KVEvent(kind="stored", keys=["0" * 32], namespace=NS)
    assert msgspec.json.decode(msgspec.json.encode(ev), type=KVEvent) == ev
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"kind": "changed", "keys": [], "namespace": "x"}', type=KVEvent)
