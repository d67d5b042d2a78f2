"""Paged KV cache storage and the arithmetic that sizes it from a memory budget.

The cache is one preallocated tensor per layer, ``[2, num_blocks, block_size, num_kv_heads,
head_dim]`` (K and V), each layer's K and V views into it, as the kernels read them. One
allocation per layer rather than one for the whole cache so that the cache can shrink and grow
back (idle memory first: the top of the cache lent to a neighbour instance on the same GPU,
site_engine/engine/core/kv_lending.py) a layer at a time: a resize holds the old cache plus one
layer of the new one at most, where one tensor would need the old and the new cache whole, more
than a GPU whose cache was sized to fill it has. Block bookkeeping (which block belongs to which
sequence) lives in the scheduler, not here.
"""

from __future__ import annotations

import math
import mmap
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


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros whose pages the kernel fills on first touch (an anonymous mapping
    is zero by contract), so a cache sized for a few full-length sequences costs what its
    sequences write, not a fill of the whole budget: SmolLM2's default CPU cache is 1.5 GB, and
    torch.zeros spent ~1 s of a core writing it at every engine's start."""
    count = math.prod(shape)
    if count == 0:  # mmap refuses an empty mapping
        return torch.zeros(shape, dtype=dtype)
    # The tensor holds the mapping (torch.frombuffer keeps a reference to its buffer); the
    # mapping is unmapped when the last tensor on it goes.
    mapping = mmap.mmap(-1, count * dtype.itemsize)
    return torch.frombuffer(mapping, dtype=dtype, count=count).view(shape)


class PagedKVCache:
    """Preallocated K/V storage for every layer, addressed by (block, offset in block).

    `resize` changes the number of blocks in place, keeping the lower blocks' contents; any
    tensor address taken before it (a CUDA graph's, a view of a layer) is stale after it."""

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
        self._dtype, self._device = dtype, device
        self._layers = [self._layer(num_blocks) for _ in range(spec.num_layers)]

    def _layer(self, num_blocks: int) -> torch.Tensor:
        spec = self.spec
        shape = (2, num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim)
        # Zeros rather than empty: a kernel that masks unused slots with -inf still multiplies
        # their V by 0, and uninitialised memory may hold NaN, which would survive that product.
        if self._device.type == "cpu":
            return lazy_zeros(shape, self._dtype)
        return torch.zeros(shape, dtype=self._dtype, device=self._device)

    def resize(self, num_blocks: int) -> None:
        """Shrinks or grows the cache to `num_blocks`, a layer at a time: blocks below both
        sizes keep their contents, blocks added are zeros. On CUDA each old layer's memory goes
        back to the driver before the next layer is allocated (another process on this GPU may
        take what a shrink frees). An allocation that fails puts the layers already resized
        back to the old size (the blocks between the sizes come back as zeros) and raises. The
        caller makes sure no queued work reads the old layers."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if not self._layers:
            raise RuntimeError("the cache was released")
        before = self.num_blocks
        done = 0
        try:
            for index in range(len(self._layers)):
                self._resize_layer(index, num_blocks)
                done += 1
        except BaseException:
            for index in range(done):
                self._resize_layer(index, before)
            raise
        self.num_blocks = num_blocks

    def _resize_layer(self, index: int, num_blocks: int) -> None:
        old = self._layers[index]
        kept = min(num_blocks, old.shape[1])
        new = self._layer(num_blocks)
        new[:, :kept].copy_(old[:, :kept])
        self._layers[index] = new
        del old
        if self._device.type == "cuda":
            # The old layer is free in torch's pool; emptied now, the next layer's allocation
            # cannot be carved out of it, so that its segment goes back to the driver whole.
            torch.cuda.empty_cache()

    def release(self) -> None:
        """Frees the storage at once (an engine that shuts down must not wait for the collector
        to find every reference); the cache holds no block afterwards."""
        self._layers = []
        self.num_blocks = 0

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def num_bytes(self) -> int:
        return sum(layer.numel() * layer.element_size() for layer in self._layers)

    @property
    def layers(self) -> tuple[torch.Tensor, ...]:
        """Each layer's [2, num_blocks, block_size, num_kv_heads, head_dim] (K then V)."""
        return tuple(self._layers)

    def key_cache(self, layer: int) -> torch.Tensor:
        """[num_blocks, block_size, num_kv_heads, head_dim] view of `layer`'s keys."""
        return self._layers[layer][0]

    def value_cache(self, layer: int) -> torch.Tensor:
        """[num_blocks, block_size, num_kv_heads, head_dim] view of `layer`'s values."""
        return self._layers[layer][1]

    def gather(self, blocks: torch.Tensor) -> torch.Tensor:
        """[num_layers, 2, len(blocks), block_size, num_kv_heads, head_dim]: copies of
        `blocks` (a long tensor on the cache's device) of every layer."""
        spec = self.spec
        shape = (spec.num_layers, 2, len(blocks), self.block_size, spec.num_kv_heads,
                 spec.head_dim)  # fmt: skip
        out = torch.empty(shape, dtype=self._dtype, device=self._device)
        for layer, stored in zip(out, self._layers, strict=True):
            torch.index_select(stored, 1, blocks, out=layer)
        return out

    def scatter(self, blocks: torch.Tensor, values: torch.Tensor) -> None:
        """Writes `values` (as `gather` returns them) into `blocks` of every layer."""
        for stored, layer in zip(self._layers, values, strict=True):
            stored.index_copy_(1, blocks, layer)
