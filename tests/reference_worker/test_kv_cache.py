"""`SequenceKV`: a cache built from chunk tensors continues exactly like the engine's own cache,
grows without losing what it holds, and never shares storage with a chunk."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("keep", [512, 400])
def test_cache_from_chunks_continues_exactly_like_the_engines_own_cache(reference_model, keep):
    from reference_worker.kv_cache import SequenceKV
    from reference_worker.model_runner import ModelRunner

    model = reference_model.model
    runner = ModelRunner(model)
    rng = random.Random(keep)
    ids = [rng.randrange(100, model.config.vocab_size) for _ in range(560)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the same reductions, so the logits are bit for bit equal
    try:
        prefix = runner.new_kv(64)
        runner.step([(prefix, ids[:512])])
        chunks = prefix.chunks(0, 2, 256)
        before = [c.clone() for c in chunks]
        # The engine's own cache of the same KV: the 512-token pass, cut to `keep`. (A separate
        # `keep`-token pass is not bit-equal: SDPA's CPU kernel blocks by sequence length.)
        own = runner.new_kv(64)
        runner.step([(own, ids[:512])])
        own.length = keep
        cache = SequenceKV.from_chunks(chunks, keep)
        assert cache.length == keep
        expected = runner.step([(own, ids[keep:])])
        got = runner.step([(cache, ids[keep:])])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(expected, got)
    assert cache.length == len(ids)
    assert all(torch.equal(c, b) for c, b in zip(chunks, before))  # the appends never wrote a chunk
    assert cache.data.data_ptr() not in {c.data_ptr() for c in chunks}


def test_growth_keeps_the_valid_tokens_and_chunks_are_copies():
    from reference_worker.kv_cache import SequenceKV

    kv = SequenceKV((2, 3, 4), torch.float32, capacity=8)
    kv.data[:, :, :, :5] = torch.arange(2 * 2 * 3 * 5 * 4, dtype=torch.float32).view(2, 2, 3, 5, 4)
    kv.length = 5
    want = kv.data[:, :, :, :5].clone()
    kv.reserve(9)
    assert kv.capacity == 16  # doubled, not grown to the exact need
    assert torch.equal(kv.data[:, :, :, :5], want)
    piece = kv.chunk(1, 4)
    assert piece.is_contiguous() and torch.equal(piece, want[:, :, :, 1:4])
    piece.zero_()
    assert torch.equal(kv.data[:, :, :, :5], want)  # a chunk never aliases the cache
    layers = kv.layers()
    assert len(layers) == 2 and layers[1][1].shape == (3, 5, 4) and torch.equal(layers[1][1], want[1, 1])
    with pytest.raises(ValueError):
        kv.chunk(3, 6)  # past the valid tokens
    with pytest.raises(ValueError):
        SequenceKV.from_chunks([want], 6)  # more tokens than the chunks hold
