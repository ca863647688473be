"""One forward pass over a batch of sequences: the only code that runs the model.

A step is a list of `(SequenceKV, new token ids)`: a decode sequence brings one token, a prefill
(or a chunk of one) many. Their tokens are packed into one row (`[1, T, hidden]`, vLLM's "varlen"
layout), so every dense layer (projections, MLP, norms, the LM head) runs once over all `T` tokens
and reads its weights once per step, which is where batching pays on a CPU: decode is bound by
reading ~0.5 GB of float32 weights per forward. Attention is the only per-sequence part: each
sequence's queries attend to its own cache (`SequenceKV`), written in place, no padding.

The forward is the model's own modules (embedding, rotary embedding, decoder layers' norms,
projections and MLP, final norm, LM head) called in the order `LlamaForCausalLM.forward` calls
them, with the attention call it makes (SDPA, `enable_gqa`, causal when a prefill starts empty).
So a sequence alone in its step computes what `model.generate` computes: a prompt prefilled in
one pass gives bit-equal logits, and a lone decode the same greedy tokens (tested). With others
in the step, the matmuls see more rows and round differently; the agreement of greedy tokens with
the sequence run alone is measured (`kvpool bench engine`), not assumed.

Llama-architecture models only (Llama, SmolLM, Mistral without sliding window, Qwen2): the
constructor checks the module names it relies on and refuses anything else. Why not
transformers' own continuous batching (`ContinuousBatchingManager`, 5.x): it owns its paged cache
and has no public way to load KV computed elsewhere or to hand a request's KV out, which is the
whole job of a worker here.

Only the engine thread calls `step`.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F

from reference_worker.kv_cache import SequenceKV
from kvpool.errors import InvalidArgument

_NEEDED = ("embed_tokens", "layers", "norm", "rotary_emb")
_LAYER = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


class ModelRunner:
    def __init__(self, model: Any):
        inner = getattr(model, "model", None)
        if inner is None or not all(hasattr(inner, a) for a in _NEEDED) or not hasattr(model, "lm_head"):
            raise InvalidArgument(f"the reference engine runs Llama-architecture models; {type(model).__name__} "
                                  "lacks the modules it needs")
        layer0 = inner.layers[0]
        if not all(hasattr(layer0, a) for a in _LAYER) or not all(hasattr(layer0.self_attn, a) for a in _ATTN):
            raise InvalidArgument(f"{type(layer0).__name__} is not a Llama-style decoder layer")
        cfg = model.config
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
            raise InvalidArgument("sliding-window attention is not supported by the reference engine")
        self.model = model
        self.inner = inner
        self.vocab_size = int(cfg.vocab_size)
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 8192))
        self.kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.scaling = float(layer0.self_attn.scaling)
        self.dtype = model.dtype
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self._rope = apply_rotary_pos_emb

    def new_kv(self, capacity: int) -> SequenceKV:
        return SequenceKV((len(self.inner.layers), self.kv_heads, self.head_dim), self.dtype, capacity)

    @torch.inference_mode()
    def step(self, work: Sequence[tuple[SequenceKV, Sequence[int]]]) -> torch.Tensor:
        """Append each entry's tokens to its cache; return the logits of each entry's last token,
        `[len(work), vocab]`. A cache's `length` advances only when the whole forward succeeded."""
        if not work:
            raise ValueError("a step needs at least one sequence")
        ids: list[int] = []
        positions: list[int] = []
        spans: list[tuple[SequenceKV, int, int, int]] = []  # kv, first row, rows, first position
        for kv, tokens in work:
            n = len(tokens)
            if n == 0:
                raise ValueError("every sequence in a step brings at least one token")
            if kv.length + n > self.max_positions:
                raise InvalidArgument(f"{kv.length + n} positions exceed the model's {self.max_positions}")
            kv.reserve(kv.length + n)
            spans.append((kv, len(ids), n, kv.length))
            ids.extend(tokens)
            positions.extend(range(kv.length, kv.length + n))
        total = len(ids)
        x = self.inner.embed_tokens(torch.tensor([ids], dtype=torch.long))
        cos, sin = self.inner.rotary_emb(x, torch.tensor([positions], dtype=torch.long))
        shape = (1, total, -1, self.head_dim)
        for li, layer in enumerate(self.inner.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(shape).transpose(1, 2)
            k = attn.k_proj(h).view(shape).transpose(1, 2)
            v = attn.v_proj(h).view(shape).transpose(1, 2)
            q, k = self._rope(q, k, cos, sin)
            out = self._attend(li, q, k, v, spans)
            x = x + attn.o_proj(out.transpose(1, 2).reshape(1, total, -1).contiguous())
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        last = [row + n - 1 for _, row, n, _ in spans]
        hidden = self.inner.norm(x)[:, last]  # all rows, then the last ones: as transformers does
        logits = self.model.lm_head(hidden)[0]
        for kv, _, n, _ in spans:
            kv.length += n
        return logits

    def _attend(self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                spans: list[tuple[SequenceKV, int, int, int]]) -> torch.Tensor:
        """`[1, heads, T, head_dim]`: each span's queries over its own cache (written here first)."""
        outs = []
        for kv, row, n, start in spans:
            end = start + n
            keys, values = kv.data[li, 0], kv.data[li, 1]
            keys[:, start:end].copy_(k[0, :, row:row + n])
            values[:, start:end].copy_(v[0, :, row:row + n])
            qs = q[:, :, row:row + n]
            kk, vv = keys[:, :end].unsqueeze(0), values[:, :end].unsqueeze(0)
            if n == 1 or start == 0:  # what transformers' SDPA path does: no mask at all
                o = F.scaled_dot_product_attention(qs, kk, vv, scale=self.scaling, is_causal=n > 1, enable_gqa=True)
            else:  # a chunk after cached tokens: causal, aligned to the end
                mask = torch.ones(n, end, dtype=torch.bool).tril(diagonal=start)
                o = F.scaled_dot_product_attention(qs, kk, vv, attn_mask=mask, scale=self.scaling, enable_gqa=True)
            outs.append(o)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
