"""Wire messages of the worker API: declared, versioned, and strict about bad input."""

from __future__ import annotations

import pytest

from kvpool.handle import KVHandle
from kvpool import worker_api as m
from kvpool.errors import InvalidArgument


def test_roundtrip_keeps_every_field():
    handle = KVHandle(namespace="ab" * 16, request_id="r1", num_tokens=300, chunk_tokens=256,
                      chunk_keys=["cd" * 16], tail_key="tail/r1")
    req = m.DecodeRequest(handle=handle, first_token=7, max_tokens=5)
    back = m.decode(m.encode(req), m.DecodeRequest)
    assert back == req and back.v == m.WIRE_VERSION


@pytest.mark.parametrize("body", [b"{", b"[]", b'{"token_ids": "nope"}', b'{"token_ids": [1], "v": 99}', b"{}"])
def test_bad_input_is_invalid_argument(body):
    with pytest.raises(InvalidArgument):
        m.decode(body, m.PrefillRequest)


def test_error_event_carries_the_code():
    event = m.error_event("r", InvalidArgument("bad"))
    assert event.done and event.error.code == "invalid_argument" and event.error.message == "bad"
