"""GPUs and model shapes: what a simulated site's step time and KV capacity are scaled by.

A step's time is fitted on one card (fedsim/step_time.py); another card's is the same model with
its memory-bound terms (weights read once a step, KV read, adapter weights) scaled by the ratio
of memory bandwidths and its compute-bound terms (per token and per attention pair) by the ratio
of dense bf16 FLOPs: the roofline's two sides. Figures are the vendors' data-sheet values (SXM
H100 and H200, PCIe L40S), dense (no sparsity).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Card:
    name: str
    memory_bytes: int
    bandwidth_bytes_s: float
    bf16_flops: float


CARDS: dict[str, Card] = {
    "h100": Card("h100", 80 * 10**9, 3.35e12, 989e12),
    "h200": Card("h200", 141 * 10**9, 4.8e12, 989e12),
    # The smaller card of an unequal federation: a quarter of the H100's bandwidth, 37% of its
    # FLOPs, 48 GB.
    "l40s": Card("l40s", 48 * 10**9, 0.864e12, 362e12),
}


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What sizes a site's KV cache: weight bytes and KV bytes per token (bf16)."""

    name: str
    weight_bytes: int
    kv_bytes_per_token: int
    max_model_len: int


MODELS: dict[str, ModelShape] = {
    # bench/results/engine/engine_h200.json's model facts (Llama-3.2-1B shape, bf16).
    "llama1b": ModelShape("llama1b", 2_471_628_800, 32_768, 4096),
    # Llama-3.1-8B: 8.03e9 parameters, 32 layers x 8 KV heads x 128 x (K, V) x 2 bytes.
    "llama8b": ModelShape("llama8b", 16_060_522_496, 131_072, 8192),
}

# What a site leaves out of its KV cache: activations, graphs, the allocator's slack.
MEMORY_UTILIZATION = 0.9


def kv_blocks(card: Card, model: ModelShape, block_size: int) -> int:
    """KV blocks a site of `model` on `card` holds."""
    free = card.memory_bytes * MEMORY_UTILIZATION - model.weight_bytes
    if free <= 0:
        raise ValueError(f"{model.name} does not fit a {card.name}")
    return int(free // (model.kv_bytes_per_token * block_size))
