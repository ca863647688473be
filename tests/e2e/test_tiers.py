"""The disaggregated path when the pool's copy lives on SSD, and when it is damaged in the tier.

Both act on the real pool process: its objects are pushed from DRAM to SSD by filling DRAM, and
a byte is flipped in the node's shared-memory DRAM arena (see `damage_in_pool`).
"""

from __future__ import annotations

import logging
import mmap
import os
import time

import pytest

from e2e_support import assert_same_tokens, filler_ids, reference
from reference_worker.client import generate
from kvpool.errors import CorruptObject
from kvpool.keys import chunk_keys_hex
from kvpool.chunk_format import HEADER_SIZE, decode_chunk

pytestmark = [pytest.mark.model, pytest.mark.timeout(900)]

NEW_TOKENS = 8


def keys_of(prefill, ids: list[int]) -> list[str]:
    info = prefill.info()
    return chunk_keys_hex(bytes.fromhex(info.namespace), ids, info.chunk_tokens)


def tier_of(pool_client, key: str) -> str:
    return pool_client.admin("key_info", key=key)["replicas"][0]["tier"]


def damage_in_pool(pool_client, key: str, payload_offset: int = 1000) -> str:
    """Flip one payload byte of `key` inside the pool; returns where it was flipped.

    Preferably in place in the node's shared-memory DRAM arena, at the offset the master reports,
    once the 64 bytes there are exactly this object's header (the master learns of demotions and
    promotions by heartbeat, so a reported offset is trusted only after that check). If the object
    stays on SSD, the damaged copy is stored in its place through the client instead.
    """
    good = pool_client.get(key)  # a read also promotes an SSD object back to DRAM
    assert good is not None
    pool_client.flush()  # release our read lease now, so the workers can drop the damaged object
    nodes = {n["node_id"]: n for n in pool_client.admin("nodes")}
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        replica = pool_client.admin("key_info", key=key)["replicas"][0]
        if replica["tier"] == "dram":
            fd = os.open(nodes[replica["node_id"]]["shm_path"], os.O_RDWR)
            try:
                with mmap.mmap(fd, 0) as arena:
                    at = replica["offset"]
                    if arena[at:at + HEADER_SIZE] == good[:HEADER_SIZE]:
                        arena[at + HEADER_SIZE + payload_offset] ^= 0x40
                        return "dram"
            finally:
                os.close(fd)
        time.sleep(0.25)
    bad = bytearray(good)
    bad[HEADER_SIZE + payload_offset] ^= 0x40
    pool_client.remove(key)
    pool_client.put(key, bad)
    return "client"


def test_corrupted_chunk_is_detected_and_recomputed(rm, prefill, decode, pool_client):
    ids = filler_ids(rm, 600, seed=77)  # two full chunks and a tail
    want = reference(rm, ids, NEW_TOKENS)
    first = generate(prefill, decode, ids, NEW_TOKENS)
    assert first.token_ids == want
    keys = keys_of(prefill, ids)
    assert len(keys) == 2

    where = damage_in_pool(pool_client, keys[0])
    prefill.clear_cache()  # so the prefix has to come from the (damaged) pool copy
    again = generate(prefill, decode, ids, NEW_TOKENS)
    logging.getLogger(__name__).info("damaged %s in %s", keys[0], where)
    assert again.pool_cached_tokens == 0 and again.computed_tokens == len(ids)  # detected: a miss
    assert again.token_ids == want  # recomputed, so still the single-pass answer
    assert "kvpool_worker_corrupt_chunks 1.0" in prefill.metrics()
    stored = pool_client.get(keys[0])  # the damaged copy is never served again: gone, or replaced
    assert stored is None or decode_chunk(stored, rm.layout(256)).tokens == 256

    # The decode side detects damage too: it refuses the handle instead of decoding wrong KV.
    head = prefill.prefill(ids)
    damage_in_pool(pool_client, keys[1])
    decode.clear_cache()
    with pytest.raises(CorruptObject):
        list(decode.decode(head.handle, head.first_token, NEW_TOKENS))
    prefill.clear_cache()
    final = generate(prefill, decode, ids, NEW_TOKENS)  # the next prefill recomputes what is gone
    # Chunk 1 was dropped by the decode worker; chunk 0 is back unless its removal (deferred while
    # an earlier reader's lease lasted) kept the re-store out: both are misses, never wrong KV.
    assert final.pool_cached_tokens in (0, 256) and final.cached_tokens + final.computed_tokens == len(ids)
    assert_same_tokens(rm, ids, final.token_ids, want)


@pytest.mark.slow  # tests/engine_adapters/test_hf.py covers the SSD hand-off in one process
def test_prefix_served_from_ssd_after_dram_eviction(rm, prefill, decode, pool_client):
    ids = filler_ids(rm, 600, seed=88)  # two full chunks and a tail
    want = reference(rm, ids, NEW_TOKENS)
    head = prefill.prefill(ids)
    keys = keys_of(prefill, ids)

    # Fill the 64 MiB DRAM tier with other objects: the prompt's chunks are demoted to SSD.
    filler = bytes(12 << 20)
    for i in range(7):
        pool_client.put(f"e2e-filler/{os.getpid()}/{i}", filler)
    deadline = time.monotonic() + 10  # the master learns where objects went by heartbeat
    while "ssd" not in (tiers := [tier_of(pool_client, k) for k in keys]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "ssd" in tiers, tiers

    # A fresh decode worker state (no local copy) pulls the KV from SSD, bit-exact.
    decode.clear_cache()
    tokens = [head.first_token] + [e.token_id for e in decode.decode(head.handle, head.first_token, NEW_TOKENS)
                                   if not e.done]
    assert tokens == want

    # A fresh prefill of the same prompt reuses the SSD-resident prefix.
    prefill.clear_cache()
    decode.clear_cache()
    again = generate(prefill, decode, ids, NEW_TOKENS)
    assert again.pool_cached_tokens == 512 and again.computed_tokens == len(ids) - 512
    assert_same_tokens(rm, ids, again.token_ids, want)


@pytest.mark.slow
@pytest.mark.parametrize("n", [300, 700, 1300, 2048])
def test_sweep_decode_from_ssd_is_exact(rm, prefill, decode, pool_client, n):
    """The 20-prompt equality, for long prompts whose KV was demoted to SSD before decode."""
    ids = filler_ids(rm, n, seed=5000 + n)
    head = prefill.prefill(ids)
    for i in range(7):
        pool_client.put(f"e2e-sweep/{os.getpid()}/{i}", bytes(12 << 20))
    decode.clear_cache()
    tokens = [head.first_token] + [e.token_id for e in decode.decode(head.handle, head.first_token, NEW_TOKENS)
                                   if not e.done]
    assert tokens == reference(rm, ids, NEW_TOKENS)
