"""The disaggregated path when the pool's copy lives on SSD, and when it is damaged in the tier.

Both act on the real pool process: its objects are pushed from DRAM to SSD by filling DRAM, and
a byte is flipped in the node's shared-memory DRAM arena at the offset the master reports.
"""

from __future__ import annotations

import mmap
import os

import pytest

from e2e_support import assert_same_tokens, filler_ids, reference
from engine_adapters.serving.client import generate
from kvpool.errors import CorruptObject
from kvpool.keys import chunk_keys_hex
from kvpool.layout import HEADER_SIZE, decode_chunk

pytestmark = [pytest.mark.model, pytest.mark.timeout(900)]

NEW_TOKENS = 8


def keys_of(prefill, ids: list[int]) -> list[str]:
    info = prefill.info()
    return chunk_keys_hex(bytes.fromhex(info.namespace), ids, info.chunk_tokens)


def tier_of(pool_client, key: str) -> str:
    return pool_client.admin("key_info", key=key)["replicas"][0]["tier"]


def flip_byte_in_dram(pool_client, key: str, payload_offset: int = 1000) -> None:
    """Flip one payload byte of `key` where it lies in the node's DRAM arena (a shm file)."""
    info = pool_client.admin("key_info", key=key)
    replica = info["replicas"][0]
    assert replica["tier"] == "dram", f"{key} is on {replica['tier']}, expected DRAM"
    (node,) = [n for n in pool_client.admin("nodes") if n["node_id"] == replica["node_id"]]
    fd = os.open(node["shm_path"], os.O_RDWR)
    try:
        with mmap.mmap(fd, 0) as arena:
            arena[replica["offset"] + HEADER_SIZE + payload_offset] ^= 0x40
    finally:
        os.close(fd)


def test_corrupted_chunk_is_detected_and_recomputed(rm, prefill, decode, pool_client):
    ids = filler_ids(rm, 600, seed=77)  # two full chunks and a tail
    want = reference(rm, ids, NEW_TOKENS)
    first = generate(prefill, decode, ids, NEW_TOKENS)
    assert first.token_ids == want
    keys = keys_of(prefill, ids)
    assert len(keys) == 2

    flip_byte_in_dram(pool_client, keys[0])
    prefill.clear_cache()  # so the prefix has to come from the (damaged) pool copy
    again = generate(prefill, decode, ids, NEW_TOKENS)
    assert again.pool_cached_tokens == 0 and again.computed_tokens == len(ids)  # detected: a miss
    assert again.token_ids == want  # recomputed, so still the single-pass answer
    assert "kvpool_worker_corrupt_chunks 1.0" in prefill.metrics()
    decode_chunk(pool_client.get(keys[0]), rm.layout(256))  # a good copy replaced the damaged one

    # The decode side detects damage too: it refuses the handle instead of decoding wrong KV.
    head = prefill.prefill(ids)
    flip_byte_in_dram(pool_client, keys[1])
    decode.clear_cache()
    with pytest.raises(CorruptObject):
        list(decode.decode(head.handle, head.first_token, NEW_TOKENS))
    prefill.clear_cache()
    final = generate(prefill, decode, ids, NEW_TOKENS)  # the next prefill recomputes the chunk
    assert final.pool_cached_tokens == 256 and final.computed_tokens == len(ids) - 256
    assert_same_tokens(rm, ids, final.token_ids, want)


def test_prefix_served_from_ssd_after_dram_eviction(rm, prefill, decode, pool_client):
    ids = filler_ids(rm, 1100, seed=88)  # four full chunks and a tail
    want = reference(rm, ids, NEW_TOKENS)
    head = prefill.prefill(ids)
    keys = keys_of(prefill, ids)

    # Fill the 64 MiB DRAM tier with other objects: the prompt's chunks are demoted to SSD.
    filler = bytes(12 << 20)
    for i in range(7):
        pool_client.put(f"e2e-filler/{os.getpid()}/{i}", filler)
    tiers = [tier_of(pool_client, k) for k in keys]
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
    assert again.pool_cached_tokens == 1024 and again.computed_tokens == len(ids) - 1024
    assert_same_tokens(rm, ids, again.token_ids, want)
