"""`prompt_sources`: one prompt's tokens and chunks by where their KV came from (what the hit
counters add). The end-to-end counts through a real worker are tests/e2e/test_hit_metrics.py."""

from __future__ import annotations

from reference_worker.metrics import prompt_sources


def test_sources_add_up_to_the_prompt():
    tokens, chunks = prompt_sources(256, 1100, 76, full_chunks=4, local_chunks=1, pool_tiers=["dram", "ssd", "ssd"])
    assert tokens == {"worker": 256, "pool_dram": 256, "pool_ssd": 512, "computed": 76}
    assert chunks == {"worker": 1, "pool_dram": 1, "pool_ssd": 2, "computed": 0}


def test_a_fully_cached_prompt_recomputes_its_last_token_once_from_the_last_source():
    tokens, _ = prompt_sources(256, 512, 1, full_chunks=2, local_chunks=0, pool_tiers=["dram", "ssd"])
    assert tokens == {"worker": 0, "pool_dram": 256, "pool_ssd": 255, "computed": 1}
    tokens, _ = prompt_sources(256, 512, 1, full_chunks=2, local_chunks=2, pool_tiers=[])
    assert tokens == {"worker": 511, "pool_dram": 0, "pool_ssd": 0, "computed": 1}


def test_a_pool_that_does_not_name_its_tier_counts_as_dram():
    tokens, chunks = prompt_sources(64, 200, 72, full_chunks=3, local_chunks=0, pool_tiers=["", ""])
    assert tokens == {"worker": 0, "pool_dram": 128, "pool_ssd": 0, "computed": 72}
    assert chunks["computed"] == 1
