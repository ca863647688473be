"""Workloads: the Mooncake trace reader, rate scaling, the reuse upper bound (checked against an
independent computation from the trace's own hash_ids), the synthetic generator."""

from __future__ import annotations

import json

import pytest

from kvpool.errors import InvalidArgument
from kvpool.tools.sim.workload import from_token_lists, load_trace, reuse_upper_bound, synthetic


def _independent_reuse(path, limit: int) -> tuple[int, int]:
    """Straight from the JSON lines, in file order: a block counts if it and every block before
    it in its prompt appeared in some earlier line."""
    seen: set = set()
    hits = total = 0
    with open(path) as f:
        for i, line in enumerate(f):
            if i >= limit:
                break
            ids = json.loads(line)["hash_ids"]
            run = 0
            while run < len(ids) and ids[run] in seen:
                run += 1
            hits += run
            total += len(ids)
            seen.update(ids)
    return hits, total


def test_trace_slice_reads_and_upper_bound_matches_independent_count(trace_path):
    w = load_trace(trace_path, limit=3000)
    assert len(w) == 3000 and w.block_tokens == 512
    assert w.requests[0].arrival_s == 0.0
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(w.requests, w.requests[1:]))
    hits, total = _independent_reuse(trace_path, 3000)
    block_ratio, token_ratio = reuse_upper_bound(w.requests, 512)
    assert block_ratio == pytest.approx(hits / total, abs=1e-12)
    assert 0.1 < block_ratio < 0.6 and 0.0 < token_ratio <= 1.0


def test_rate_scale_compresses_arrivals(trace_path):
    w = load_trace(trace_path, limit=200)
    fast = w.scaled(4.0)
    assert fast.rate == pytest.approx(4 * w.rate)
    assert [r.blocks for r in fast.requests] == [r.blocks for r in w.requests]
    with pytest.raises(InvalidArgument):
        w.scaled(0)


def test_bad_trace_lines_are_clear_errors(tmp_path):
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10}\n')
    with pytest.raises(InvalidArgument, match="not a Mooncake trace line"):
        load_trace(bad)
    with pytest.raises(InvalidArgument, match="not found"):
        load_trace(tmp_path / "missing.jsonl")


def test_synthetic_sessions_share_prefixes_and_are_seeded():
    a, b = synthetic(300, 5.0, seed=3), synthetic(300, 5.0, seed=3)
    assert a.requests == b.requests
    assert all(len(r.blocks) == -(-r.prompt_tokens // 512) for r in a.requests)
    assert reuse_upper_bound(a.requests, 512)[0] > 0.3  # system prompts and earlier turns


def test_token_lists_chain_blocks_by_prefix():
    base = list(range(600))
    w = from_token_lists([base, base[:512] + [7] * 88, base], [4, 4, 4], [0.0, 1.0, 2.0], 256)
    first, second, third = w.requests
    assert first.blocks == third.blocks
    assert second.blocks[:2] == first.blocks[:2] and second.blocks[2] != first.blocks[2]
