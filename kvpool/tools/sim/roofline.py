"""GPU performance profiles from first principles (a roofline), for models and cards we cannot
run here. Sources for every constant are in docs/sim.md ("GPU profiles").

    prefill of c new tokens after k cached:   FLOPs = 2*P*c + 4*L*Hq*d*c*(k + c/2)
        time = p0 + max(weights / (HBM*mbu), FLOPs / (peak*mfu_prefill))
    decode step of B sequences holding kv tokens:
        time = d0 + max((weights + kv*kv_bytes) / (HBM*mbu), 2*P*B / (peak*mfu_decode))

P parameters, L layers, Hq query heads of dimension d; weights = P * bytes per parameter; one
token's KV = 2 (K and V) * L * Hkv * d * bytes. Tensor parallelism over n cards multiplies peak
FLOPs and HBM bandwidth by n times `tp_efficiency` (all-reduce time and imbalance).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.errors import InvalidArgument
from kvpool.tools.sim.profile import Profile


@dataclass(frozen=True)
class Card:
    name: str
    bf16_tflops: float  # dense tensor-core peak
    hbm_tb_s: float
    hbm_gb: float
    price_per_hour: float  # one card, on demand (assumed list price; see docs/sim.md)


@dataclass(frozen=True)
class Model:
    name: str
    params: float
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    bytes_per_param: int = 2  # bf16

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param


CARDS = {
    "h100": Card("H100-SXM5-80GB", 989.0, 3.35, 80, 2.99),
    "h200": Card("H200-SXM-141GB", 989.0, 4.8, 141, 3.79),
    "a100": Card("A100-SXM4-80GB", 312.0, 2.039, 80, 1.79),
    "l40s": Card("L40S-48GB", 362.0, 0.864, 48, 1.09),
}

MODELS = {
    "llama3-8b": Model("Llama-3.1-8B", 8.03e9, 32, 32, 8, 128),
    "llama3-70b": Model("Llama-3.1-70B", 70.6e9, 80, 64, 8, 128),
}

# Efficiency constants (docs/sim.md names where each comes from).
MFU_PREFILL = 0.55  # achieved / peak FLOPs in long-prompt prefill
MFU_DECODE = 0.35  # matmuls of a decode batch (small M): tensor cores run far from peak
MBU = 0.70  # achieved / peak HBM bandwidth when streaming weights and KV
TP_EFFICIENCY = 0.85  # per-card efficiency kept under tensor parallelism over NVLink (8 cards)
STEP_OVERHEAD_S = 0.004  # per forward: scheduling, sampling, kernel launches (CUDA graphs help decode)
PREFILL_OVERHEAD_S = 0.010
# KV movement (per instance): one 200 Gb/s NIC (25 GB/s) for 1 card, 8 x 400 Gb/s for 8 cards
NIC_BYTES_PER_S = {1: 25e9, 8: 400e9}
DRAM_READ_BYTES_PER_S = 20e9  # pinned host DRAM -> NIC, per pool node
SSD_READ_BYTES_PER_S = 6e9  # one NVMe Gen4 drive, sequential
CHUNK_TOKENS = 2048  # prefill chunk a colocated GPU engine fuses with decode (Sarathi-Serve range)


def build(card_key: str, model_key: str, cards: int = 1, price_per_card: float | None = None) -> Profile:
    """The roofline profile of `model_key` served on `cards` x `card_key` with tensor parallelism."""
    if card_key not in CARDS or model_key not in MODELS:
        raise InvalidArgument(f"unknown card or model: choose cards {sorted(CARDS)}, models {sorted(MODELS)}")
    card, model = CARDS[card_key], MODELS[model_key]
    scale = cards * (TP_EFFICIENCY if cards > 1 else 1.0)
    flops = card.bf16_tflops * 1e12 * scale
    hbm = card.hbm_tb_s * 1e12 * scale
    weights = model.params * model.bytes_per_param
    kv_bytes = model.kv_bytes_per_token
    free = card.hbm_gb * 1e9 * cards * 0.9 - weights  # 10% for activations and the runtime
    if free <= 0:
        raise InvalidArgument(f"{model.name} does not fit on {cards} x {card.name}")
    nic = NIC_BYTES_PER_S.get(cards, 25e9 * cards)
    price = (card.price_per_hour if price_per_card is None else price_per_card) * cards
    return Profile(
        name=f"{card_key}x{cards}-{model_key}" if cards > 1 else f"{card_key}-{model_key}",
        description=f"roofline: {model.name} on {cards} x {card.name} (bf16, TP={cards})",
        p0=PREFILL_OVERHEAD_S, p_tok=2 * model.params / (flops * MFU_PREFILL),
        p_attn=4 * model.layers * model.q_heads * model.head_dim / (flops * MFU_PREFILL),
        p_floor=weights / (hbm * MBU),
        d0=STEP_OVERHEAD_S, d_seq=0.0, d_weights=weights / (hbm * MBU), d_kv=kv_bytes / (hbm * MBU),
        d_tok=2 * model.params / (flops * MFU_DECODE), fused=True, prefill_chunk_tokens=CHUNK_TOKENS,
        bytes_per_token=kv_bytes, link_bytes_per_s=nic, dram_read_bytes_per_s=DRAM_READ_BYTES_PER_S,
        ssd_read_bytes_per_s=SSD_READ_BYTES_PER_S, push_bytes_per_s=min(nic, DRAM_READ_BYTES_PER_S),
        rpc_s=0.002, max_batch=256, max_kv_tokens=int(free // kv_bytes), price_per_hour=price, cards=cards,
        card=card.name, model=model.name)


GPU_PROFILES = {
    "h100-llama3-8b": ("h100", "llama3-8b", 1),
    "a100-llama3-8b": ("a100", "llama3-8b", 1),
    "h200-llama3-8b": ("h200", "llama3-8b", 1),
    "l40s-llama3-8b": ("l40s", "llama3-8b", 1),
    "h100x8-llama3-70b": ("h100", "llama3-70b", 8),
    "a100x8-llama3-70b": ("a100", "llama3-70b", 8),
    "h200x8-llama3-70b": ("h200", "llama3-70b", 8),
}


def gpu_profile(name: str) -> Profile:
    try:
        card, model, cards = GPU_PROFILES[name]
    except KeyError:
        raise InvalidArgument(f"unknown GPU profile {name!r}; choose one of {sorted(GPU_PROFILES)}") from None
    return build(card, model, cards)
