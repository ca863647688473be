"""Forward passes of the model on batch-1 KV caches, the only code that runs the model.

Every call is one sequence (batch 1) with no attention mask and `logits_to_keep=1`, exactly how
`model.generate` runs greedy decoding of one prompt. That is what keeps the disaggregated path
token-for-token equal to a single-process `generate`: a padded multi-sequence forward changes
the matmul shapes (and so float rounding), which can flip a greedy choice at a near-tie. The
scheduler still batches at the request level (sequences join and leave between steps); within
one step it runs each sequence in turn (see `scheduler.py`).

Only the scheduler thread calls a runner; it holds no state of its own.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


class ModelRunner:
    def __init__(self, model: Any):
        self.model = model
        self.vocab_size = int(model.config.vocab_size)
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 8192))

    def extend(self, cache: Any, token_ids: Sequence[int]) -> torch.Tensor:
        """Append `token_ids` to `cache` (in place) and return the logits of the last position."""
        input_ids = torch.tensor([list(token_ids)], dtype=torch.long)
        with torch.inference_mode():
            out = self.model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]

    @staticmethod
    def greedy(logits: torch.Tensor) -> int:
        return int(torch.argmax(logits))
