"""The engine-free half of the adapters (`engine_adapters.chunk_store`), without the model."""

from __future__ import annotations

import numpy as np
import pytest

from engine_adapters.base import KVEvent
from engine_adapters.chunk_store import ChunkStore, check_token_ids
from kvpool.chunk_format import seal_into
from kvpool.chunk_format import HEADER_SIZE, KVLayout, decode_chunk, encode_chunk
from kvpool.errors import InvalidArgument
from kvpool.keys import Namespace


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("tokens", [1, 7, 8])
def test_sealing_a_filled_payload_gives_the_encoder_bytes(dtype, tokens):
    layout = KVLayout(3, 2, 4, dtype, 8)
    rng = np.random.default_rng(tokens)
    kv = rng.integers(0, 1 << 16, size=layout.shape(tokens), dtype=np.uint16)
    if dtype == "float32":
        kv = rng.standard_normal(layout.shape(tokens)).astype(np.float32)
    elif dtype == "float16":
        kv = kv.view(np.float16)
    expected = encode_chunk(layout, kv, tokens)
    buf = bytearray(layout.object_nbytes(tokens))
    buf[HEADER_SIZE:] = memoryview(np.ascontiguousarray(kv)).cast("B")
    seal_into(buf, layout, tokens)
    assert buf == expected
    assert decode_chunk(buf, layout).tokens == tokens


@pytest.mark.parametrize("bad", [[1.5, 2], ["a"], [[1, 2]], [-1], [2**32], "abc"])
def test_token_ids_are_never_rounded_or_coerced(bad):
    with pytest.raises(InvalidArgument):
        check_token_ids(bad)


def test_token_ids_accept_numpy_and_empty():
    assert check_token_ids(np.arange(3, dtype=np.uint32)) == [0, 1, 2]
    assert check_token_ids([]) == []


def test_a_failing_listener_does_not_stop_the_others():
    ns = Namespace("m", "f" * 32, KVLayout(1, 1, 2, "float32", 4))
    store = ChunkStore(pool=None, namespace=ns)  # emit never touches the pool
    seen: list[KVEvent] = []

    def broken(event: KVEvent) -> None:
        raise RuntimeError("listener bug")

    store.add_listener(broken)
    store.add_listener(seen.append)
    store.emit("stored", ["0" * 32])
    assert [(e.kind, e.keys, e.namespace) for e in seen] == [("stored", ["0" * 32], ns.hex())]
    store.remove_listener(seen.append)
    store.emit("removed", ["0" * 32])
    assert len(seen) == 1
