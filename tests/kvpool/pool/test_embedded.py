"""The SDK against an embedded pool (master + node in this process), over shm and over TCP."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest
import torch

import kvpool
import kvpool.messages
from kvpool.contract import PoolClient
from kvpool.client import connect_async
from kvpool.errors import InvalidArgument, KeyNotFound, ObjectTooLarge, Unavailable


def test_client_satisfies_the_protocol(client):
    assert isinstance(client, PoolClient)


def test_put_get_roundtrip_exact_bytes(client):
    values = {f"k{i}": os.urandom(n) for i, n in enumerate([1, 7, 4096, 65536, 1 << 20, 3 * 1024 * 1024 + 5])}
    for key, value in values.items():
        client.put(key, value)
    for key, value in values.items():
        assert client.get(key) == value
        assert client.exists(key)


def test_missing_key_is_a_typed_miss(client):
    assert client.get("nope") is None
    with pytest.raises(KeyNotFound):
        client.get_into("nope", bytearray(16))
    assert client.exists("nope") is False
    assert client.remove("nope") is False


def test_first_writer_wins(client):
    client.put("same", b"first")
    client.put("same", b"second-and-longer")
    assert client.get("same") == b"first"


def test_get_into_and_put_from_buffers_and_tensors(client):
    t = torch.arange(1000, dtype=torch.float32)
    client.put_from("tensor", t)
    out = torch.empty(1000, dtype=torch.float32)
    assert client.get_into("tensor", out) == 4000
    assert torch.equal(out, t)
    arr = np.arange(256, dtype=np.uint16)
    client.put("array", arr)
    back = np.zeros(256, dtype=np.uint16)
    assert client.get_into("array", back) == 512
    assert np.array_equal(arr, back)
    with pytest.raises(InvalidArgument):
        client.get_into("array", bytearray(10))  # too small: typed error, nothing written past it
    with pytest.raises(InvalidArgument):
        client.get_into("array", b"read-only-buffer-that-is-big-enough-" * 100)


def test_remove_then_miss_then_put_again(client):
    client.put("r", b"one")
    assert client.remove("r") is True
    assert client.get("r") is None
    client.put("r", b"two")
    assert client.get("r") == b"two"


def test_batch_forms_keep_order_and_isolate_bad_items(client):
    items = [("b0", b"zero"), ("", b"bad key"), ("b2", b"two"), ("b3", "not bytes"), ("b4", b"")]
    errors = client.put_batch(items)
    assert errors[0] is None and errors[2] is None
    assert isinstance(errors[1], InvalidArgument)
    assert isinstance(errors[3], InvalidArgument)
    assert isinstance(errors[4], InvalidArgument)
    assert client.get_batch(["b2", "missing", "", "b0"]) == [b"two", None, None, b"zero"]
    assert client.exists_batch(["b0", "b1", "b2"]) == [True, False, True]
    assert client.remove_batch(["b0", "missing"]) == [True, False]
    assert client.get("b0") is None


def test_get_batch_into_fills_caller_buffers(client):
    values = [os.urandom(n) for n in (100, 40_000, 300_000)]  # inline and pinned sizes
    keys = [f"gbi{i}" for i in range(3)]
    assert client.put_batch(list(zip(keys, values))) == [None] * 3
    bufs = [np.zeros(300_000, np.uint8) for _ in range(5)]
    sizes = client.get_batch_into(keys + ["missing", ""], bufs)
    assert sizes == [100, 40_000, 300_000, -1, -1]
    for v, b in zip(values, bufs):
        assert bytes(b[: len(v)]) == v
    with pytest.raises(InvalidArgument):
        client.get_batch_into(keys, [bytearray(10), bytearray(10), bytearray(10)])
    assert client.get(keys[2]) == values[2]  # the stream stayed in frame
    with pytest.raises(InvalidArgument):
        client.get_batch_into(keys, bufs[:2])
    small = [os.urandom(n) for n in (100, 200, 300)]
    client.put_batch([(f"sm{i}", v) for i, v in enumerate(small)])
    outs = [bytearray(100), bytearray(10), bytearray(300)]
    with pytest.raises(InvalidArgument):  # the middle buffer is too small; the others are filled
        client.get_batch_into([f"sm{i}" for i in range(3)], outs)
    assert outs[0] == small[0] and outs[2][:300] == small[2]
    assert client.get_batch([f"sm{i}" for i in range(3)]) == small


def test_match_prefix_is_the_longest_present_run(client):
    keys = [f"{i:032x}" for i in range(10)]
    for k in keys[:6]:
        client.put(k, b"x" * 100)
    client.put(keys[7], b"y")  # after a hole: not part of the prefix
    assert client.match_prefix(keys) == 6
    assert client.match_prefix(keys[:3]) == 3
    assert client.match_prefix([]) == 0


def test_bad_input_gets_typed_errors_and_server_keeps_serving(client, pool):
    with pytest.raises(ObjectTooLarge):
        client.put("huge", bytearray(pool.settings.node.dram_capacity + 1))
    for bad in ["", "x" * 513, "nul\x00key", 42, b"bytes-key"]:
        with pytest.raises(InvalidArgument):
            client.put(bad, b"v")
        with pytest.raises(InvalidArgument):
            client.get(bad)
    with pytest.raises(InvalidArgument):
        client.put("str-value", "text")
    with pytest.raises(KeyNotFound):
        client.admin("node", node_id="no-such-node")
    with pytest.raises(KeyNotFound):
        pool.master.admin.drain_node("no-such-node")
    with pytest.raises(InvalidArgument):
        client.admin("remove_node", node_id="x")  # mutations are not on the RPC port
    # Still serving, and nothing was half-stored.
    client.put("after", b"fine")
    assert client.get("after") == b"fine"
    assert client.get("huge") is None


def test_utf8_keys_up_to_512_bytes(client):
    key = "é" * 256  # 512 UTF-8 bytes
    client.put(key, b"accented")
    assert client.get(key) == b"accented"
    client.put("tail/req-42", b"tail")
    assert client.get("tail/req-42") == b"tail"


def test_two_clients_share_the_pool(pool):
    a = kvpool.connect(pool.address)
    b = kvpool.connect(pool.address, use_shm=False)
    try:
        a.put("shared", b"from a")
        assert b.get("shared") == b"from a"
        b.remove("shared")
        assert a.get("shared") is None
    finally:
        a.close()
        b.close()


def test_unreachable_pool_is_unavailable():
    with pytest.raises(Unavailable):
        kvpool.connect("127.0.0.1:1", timeout=0.5)


def test_asyncio_client(pool):
    async def main():
        c = await connect_async(pool.address, concurrency=3)
        try:
            await asyncio.gather(*(c.put(f"a{i}", bytes([i]) * 1000) for i in range(20)))
            got = await asyncio.gather(*(c.get(f"a{i}") for i in range(20)))
            assert got == [bytes([i]) * 1000 for i in range(20)]
            assert await c.get("missing") is None
            assert await c.match_prefix([f"a{i}" for i in range(3)] + ["zz"]) == 3
            assert await c.exists_batch(["a1", "zz"]) == [True, False]
            with pytest.raises(InvalidArgument):
                await c.put("", b"x")
        finally:
            await c.close()

    asyncio.run(main())


def test_leased_object_is_removed_only_after_release(pool):
    c = kvpool.connect(pool.address)
    try:
        c.put("leased", b"v" * 10)
        lease_id, entries = pool.master.lookup(["leased"])  # a lease, as a cluster-mode reader takes
        assert entries[0] is not None and lease_id
        assert c.remove("leased") is True
        assert c.get("leased") is None  # hidden at once
        assert pool.master.admin.key_info("leased")["state"] == "removing"
        assert pool.master.admin.evict(keys=["leased"])["evicted"] == 0
        pool.master.release([lease_id])
        with pytest.raises(KeyNotFound):
            pool.master.admin.key_info("leased")
    finally:
        c.close()


def _pinned(pool) -> int:
    return pool.node.store.stats()["total"]["pinned"]


def test_shm_pins_are_released_by_piggyback_flush_and_close(pool):
    c = kvpool.connect(pool.address)
    assert c._nodes[pool.address].shm
    big = os.urandom(256 * 1024)  # above the inline size: read through the mapping, pinned meanwhile
    c.put("p1", big)
    c.put("p2", big)
    for key in ("p1", "p2"):  # out of the shm index (as when it is full): reads pin through the node
        pool.node.store.hide(key)
    assert c.get("p1") == big
    assert _pinned(pool) == 1  # released with the next request, not by an extra round trip
    assert c.get("p2") == big
    assert _pinned(pool) == 1  # p1's pin rode on p2's request
    c.flush()
    assert wait_until(lambda: _pinned(pool) == 0)
    assert c.get("p1") == big
    c.close()  # a closed connection drops whatever it still pins
    assert wait_until(lambda: _pinned(pool) == 0)


def test_removing_an_object_a_reader_has_pinned_keeps_its_bytes_until_unpin(pool):
    reader = kvpool.connect(pool.address)
    other = kvpool.connect(pool.address, use_shm=False)
    value = os.urandom(128 * 1024)
    reader.put("pinned", value)
    node = reader._nodes[pool.address]
    pins = node.rpc.call(kvpool.messages.NodePin(["pinned"], []))
    assert pins.sizes == [len(value)] and pins.offsets[0] >= 0
    assert other.remove("pinned") is True
    assert other.get("pinned") is None
    other.put("filler", os.urandom(len(value)))  # may not reuse the pinned bytes
    o = pins.offsets[0]
    assert bytes(node.arena[o:o + len(value)]) == value
    node.unpins.append(pins.pin_id)
    reader.close()
    other.close()
    assert wait_until(lambda: _pinned(pool) == 0)


def wait_until(pred, timeout=5.0):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def test_dram_overflow_demotes_to_ssd_and_every_object_stays_readable(tmp_path):
    from kvpool.config import load_settings
    from kvpool.embedded import EmbeddedPool

    settings = load_settings(port=0, admin_port=0, dram_capacity="4MiB", ssd_path=str(tmp_path / "ssd"),
                             ssd_capacity="64MiB", heartbeat_s=0.2)
    with EmbeddedPool(settings) as pool:
        for shm in (True, False):
            with kvpool.connect(pool.address, use_shm=shm) as c:
                values = {f"s{shm}{i}": os.urandom(512 * 1024) for i in range(24)}  # 12 MiB through 4 MiB of DRAM
                for k, v in values.items():
                    c.put(k, v)
                assert pool.node.store.stats()["tiers"]["ssd"]["objects"] > 0
                for k, v in values.items():  # SSD hits are promoted back into DRAM to be served
                    assert c.get(k) == v
                assert c.match_prefix(list(values)) == len(values)


def test_dram_full_without_ssd_evicts_and_reports_misses_not_garbage(tmp_path):
    from kvpool.config import load_settings
    from kvpool.embedded import EmbeddedPool

    settings = load_settings(port=0, admin_port=0, dram_capacity="4MiB", heartbeat_s=0.2)
    with EmbeddedPool(settings) as pool, kvpool.connect(pool.address) as c:
        values = {f"e{i}": os.urandom(512 * 1024) for i in range(24)}
        for k, v in values.items():
            c.put(k, v)
        got = c.get_batch(list(values))
        assert any(g is None for g in got) and got[-1] == values["e23"]
        for (k, v), g in zip(values.items(), got):
            assert g is None or g == v
        present = c.exists_batch(list(values))
        assert present == [g is not None for g in got]  # the master's index follows the node's evictions
        assert pool.master.admin.stats()["objects"] == sum(present)


def test_a_forgotten_shm_pin_expires_after_the_lease(tmp_path):
    from kvpool.config import load_settings
    from kvpool.messages import NodePin
    from kvpool.embedded import EmbeddedPool

    settings = load_settings(port=0, admin_port=0, dram_capacity="8MiB", heartbeat_s=0.1, lease_s=0.3)
    with EmbeddedPool(settings) as pool, kvpool.connect(pool.address) as c:
        c.put("forgotten", os.urandom(100_000))
        pins = c._nodes[pool.address].rpc.call(NodePin(["forgotten"], []))
        assert pins.pin_id and _pinned(pool) == 1
        assert wait_until(lambda: _pinned(pool) == 0, timeout=5)  # the connection is still open
        assert c.get("forgotten") is not None


@pytest.mark.parametrize("mode", ["shm", "tcp", "engine"])
def test_a_batch_larger_than_dram_is_served_from_ssd_not_missed(tmp_path, mode):
    """A batch cannot pin more objects in DRAM than fit: the rest are read straight from SSD.
    (Regression: they used to come back as misses while single gets found them.)"""
    from kvpool.config import load_settings
    from kvpool.embedded import EmbeddedPool

    settings = load_settings(port=0, admin_port=0, dram_capacity="4MiB", ssd_path=str(tmp_path / "ssd"),
                             ssd_capacity="64MiB", heartbeat_s=0.2)
    with EmbeddedPool(settings) as pool:
        kwargs = {"use_shm": mode == "shm", "data_path": "engine" if mode == "engine" else "rpc"}
        if mode == "engine":
            kwargs["transports"] = ("tcp",)
        with kvpool.connect(pool.address, **kwargs) as c:
            values = {f"b{i}": os.urandom(1 << 20) for i in range(12)}  # 12 MiB through 4 MiB of DRAM
            for k, v in values.items():
                c.put(k, v)
            assert pool.node.store.stats()["tiers"]["ssd"]["objects"] > 0
            assert c.get_batch(list(values)) == list(values.values())
            outs = [bytearray(1 << 20) for _ in values]
            assert c.get_batch_into(list(values), outs) == [1 << 20] * len(values)
            assert [bytes(o) for o in outs] == list(values.values())
