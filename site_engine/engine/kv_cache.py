"""Paged KV cache storage and the arithmetic that sizes it from a memory budget.

The cache is one preallocated tensor of shape
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` so that a site can size,
zero, offload or account for it as a single allocation; each layer's K and V are views into it.
Block bookkeeping (which block belongs to which sequence) lives in the scheduler, not here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """The model dimensions that determine the size of one KV block."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def from_config(cls, config: Any) -> KVCacheSpec:
        """Read the dimensions from a transformers config (Llama-style or GPT-2 naming)."""
        num_heads = int(config.num_attention_heads)
        # GPT-2 has no GQA field; Llama-family configs may leave head_dim unset (None).
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        return cls(
            num_layers=int(config.num_hidden_layers),
            num_kv_heads=int(num_kv_heads),
            head_dim=int(head_dim),
        )


def dtype_size(dtype: torch.dtype) -> int:
    """Bytes per element of `dtype`."""
    return torch.empty((), dtype=dtype).element_size()


def kv_cache_bytes_per_block(spec: KVCacheSpec, block_size: int, dtype: torch.dtype) -> int:
    """Bytes that one block occupies across all layers, K and V together."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * dtype_size(dtype)
    return per_token * block_size


def num_blocks_for_budget(
    budget_bytes: int, spec: KVCacheSpec, block_size: int, dtype: torch.dtype
) -> int:
    """How many whole blocks fit in `budget_bytes` (0 if not even one does)."""
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    return budget_bytes // kv_cache_bytes_per_block(spec, block_size, dtype)


class PagedKVCache:
    """Preallocated K/V storage for every layer, addressed by (block, offset in block)."""

    def __init__(
        self,
        spec: KVCacheSpec,
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (spec.num_layers, 2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        # Zeros rather than empty: a kernel that masks unused slots with -inf still multiplies
        # their V by 0, and uninitialised memory may hold NaN, which would survive that product.
        self.tensor = torch.zeros(shape, dtype=dtype, device=device)

    def release(self) -> None:
        """Frees the storage at once (an engine that shuts down must not wait for the collector
        to find every reference); the cache holds no block afterwards."""
        self.tensor = torch.empty(0, dtype=self.tensor.dtype, device=self.tensor.device)
        self.num_blocks = 0

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    @property
    def num_bytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def key_cache(self, layer: int) -> torch.Tensor:
        """[num_blocks, block_size, num_kv_heads, head_dim] view of `layer`'s keys."""
        return self.tensor[layer, 0]

    def value_cache(self, layer: int) -> torch.Tensor:
        """[num_blocks, block_size, num_kv_heads, head_dim] view of `layer`'s values."""
        return self.tensor[layer, 1]
