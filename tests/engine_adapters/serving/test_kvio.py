"""`cache_from_chunks`: a cache built from chunk tensors without assembling them first
(`ChunkedLayer`), which computes what the engine's own cache computes and never writes a chunk."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("keep", [512, 400])
def test_chunked_cache_continues_exactly_like_the_engines_own_cache(reference_model, keep):
    from transformers import DynamicCache

    from engine_adapters.serving.kvio import cache_from_chunks, chunks_from_cache
    from engine_adapters.serving.runner import ModelRunner

    model = reference_model.model
    runner = ModelRunner(model)
    rng = random.Random(keep)
    ids = [rng.randrange(100, model.config.vocab_size) for _ in range(560)]
    prefix = DynamicCache(config=model.config)
    runner.extend(prefix, ids[:512])
    chunks = chunks_from_cache(prefix, 0, 2, 256)
    before = [c.clone() for c in chunks]

    # The engine's own cache of the same KV: the 512-token pass, cropped to `keep`. (A separate
    # `keep`-token pass is not bit-equal: sdpa's CPU kernel blocks by sequence length, so from
    # layer 1 on its KV differs in the last bits, ~1e-5.)
    own = DynamicCache(config=model.config)
    runner.extend(own, ids[:512])
    if keep < 512:
        own.crop(keep - 512)  # (transformers 5: a negative count of tokens to drop)
    cache = cache_from_chunks(chunks, keep)
    assert cache.get_seq_length() == keep
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the same reductions, so the logits are bit for bit equal
    try:
        expected = runner.extend(own, ids[keep:])
        got = runner.extend(cache, ids[keep:])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(expected, got)
    assert cache.get_seq_length() == len(ids)
    assert all(torch.equal(c, b) for c, b in zip(chunks, before))  # the appends never wrote a chunk

    read = cache_from_chunks(chunks, keep)  # read before any append: joined alone, a fresh tensor
    assert torch.equal(read.layers[5].values[0], torch.cat([c[5, 1] for c in chunks], dim=1)[:, :keep])
    assert read.layers[5].values.data_ptr() not in {c.data_ptr() for c in chunks}
