"""Helpers shared by the e2e tests (a module name no other test folder uses)."""

from __future__ import annotations

import random

import pytest


def reference(rm, ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens of a single-process `model.generate` (stops after EOS, as the workers do)."""
    import torch

    with torch.inference_mode():
        out = rm.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(ids):].tolist()


def filler_ids(rm, n: int, seed: int) -> list[int]:
    """`n` token ids of word salad, different for each seed from the first token on."""
    rng = random.Random(seed)
    words = ("harbour ship pilot morning evening channel buoy north south river bridge market tower "
             "garden winter summer lantern engine signal anchor island coast letter number seven").split()
    text = f"Record {seed}: " + " ".join(rng.choice(words) for _ in range(n))
    ids = rm.encode(text)
    assert len(ids) >= n
    return ids[:n]


def assert_same_tokens(rm, ids: list[int], got: list[int], want: list[int]) -> None:
    """Equal tokens; on a flip, fail with the reference's top-2 logit margin at that step."""
    if got == want:
        return
    import torch

    i = next((k for k in range(min(len(got), len(want))) if got[k] != want[k]), min(len(got), len(want)))
    with torch.inference_mode():
        logits = rm.model(torch.tensor([ids + want[:i]])).logits[0, -1]
    top = torch.topk(logits, 2).values
    pytest.fail(f"greedy tokens differ at step {i}: got {got}, want {want}; reference top-2 margin there "
                f"{float(top[0] - top[1]):.3e} (a near-tie flip is a finding to report, not to loosen)")
