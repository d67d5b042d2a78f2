"""Attention over the paged KV cache for one flat batch of chunks.

Models only see the `AttentionBackend` protocol: they hand it this layer's new Q/K/V for every
token of the flat batch plus the layer's cache views, and get the attention output back. The
backend both stores the new K/V and attends, so a fused GPU kernel (FlashAttention varlen with a
paged cache, FlexAttention with a block mask, a Triton kernel) can replace the reference below
without touching the models. Per-step planning such a kernel needs (block masks, work splits) goes
in `prepare`, which the runner calls once per step before the forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Flat description of one step's batch, shared by every layer.

    Sequence i owns query rows ``query_start_loc[i] : query_start_loc[i + 1]`` of the flat batch;
    those are its last ``num_queries`` positions out of ``context_lens[i]`` KV positions (cache
    contents plus the tokens of this step). ``block_tables`` rows are padded with block 0, which
    kernels never read because they stop at the context length.
    """

    slot_mapping: torch.Tensor  # [T] int64: flat cache slot of each new token
    query_start_loc: torch.Tensor  # [B + 1] int32: cumulative query offsets (cu_seqlens_q)
    context_lens: torch.Tensor  # [B] int32: KV length of each sequence after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32: physical blocks, padded with 0
    max_query_len: int
    max_context_len: int
    # Host copies, so a reference or a kernel launcher can loop without device syncs.
    query_start_loc_host: tuple[int, ...]
    context_lens_host: tuple[int, ...]
    # A captured step graph's metadata: the host tuples are its bounds, not its chunks.
    for_graph: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens_host)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_host[-1]


class AttentionBackend(Protocol):
    """What a model needs from attention; implementations may be fused GPU kernels."""

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Called once per step, before any layer runs, with that step's metadata."""

    def needs_eager(self, chunks: Sequence[tuple[int, int]]) -> bool:
        """Whether a step with these chunks ((new tokens, context length after the step) each)
        must run eagerly (a path whose shapes a captured graph cannot hold)."""
        ...

    def describe(self) -> str:
        """The kernels this backend runs, for the start-up report."""
        ...

    def close(self) -> None:
        """Frees what the backend holds on the device (library handles, built plans)."""
        ...

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Store `key`/`value` in the cache at `metadata.slot_mapping`, then attend.

        query: [T, num_heads, head_dim]; key, value: [T, num_kv_heads, head_dim];
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim].
        Returns [T, num_heads, head_dim]. With `sliding_window` w, a query at position p sees
        only KV positions > p - w (the transformers convention).
        """
        ...


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter the new K/V rows into their cache slots (in place)."""
    num_kv_heads, head_dim = key_cache.shape[-2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(
        0, slot_mapping, value.to(value_cache.dtype)
    )


def _gather_sequence(
    cache: torch.Tensor, block_table: torch.Tensor, context_len: int
) -> torch.Tensor:
    """[context_len, num_kv_heads, head_dim] cache rows of one sequence, in position order."""
    block_size = cache.shape[1]
    num_blocks = -(-context_len // block_size)
    blocks = cache.index_select(0, block_table[:num_blocks])
    return blocks.flatten(0, 1)[:context_len]


def _attention_mask(
    num_queries: int, context_len: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor | None:
    """Boolean [num_queries, context_len] mask (True = attend), or None when all are allowed."""
    window_covers_all = sliding_window is None or context_len <= sliding_window
    if num_queries == 1 and window_covers_all:
        return None
    q_pos = torch.arange(context_len - num_queries, context_len, device=device)[:, None]
    kv_pos = torch.arange(context_len, device=device)[None, :]
    allowed = kv_pos <= q_pos
    if sliding_window is not None:
        allowed &= kv_pos > q_pos - sliding_window
    return allowed


class TorchReferenceAttention:
    """Portable backend: loops over sequences and calls SDPA on each one's gathered KV.

    Nothing is padded to the longest sequence; the cost is one small SDPA call per sequence,
    which is fine on CPU and for correctness checks, not for GPU throughput.
    """

    def prepare(self, metadata: AttentionMetadata) -> None:
        del metadata  # nothing to plan for the reference path

    def needs_eager(self, chunks: Sequence[tuple[int, int]]) -> bool:
        del chunks
        return False

    def describe(self) -> str:
        return "attention: torch SDPA per sequence (reference)"

    def close(self) -> None:
        return None  # holds nothing beyond the step

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        write_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
        out = torch.empty_like(query)
        starts = metadata.query_start_loc_host
        for i, context_len in enumerate(metadata.context_lens_host):
            begin, end = starts[i], starts[i + 1]
            table = metadata.block_tables[i]
            k = _gather_sequence(key_cache, table, context_len).to(query.dtype)
            v = _gather_sequence(value_cache, table, context_len).to(query.dtype)
            num_queries = end - begin
            mask = _attention_mask(num_queries, context_len, sliding_window, query.device)
            # SDPA wants [batch, heads, seq, head_dim]; enable_gqa broadcasts the KV heads.
            attended = torch.nn.functional.scaled_dot_product_attention(
                query[begin:end].transpose(0, 1).unsqueeze(0),
                k.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                scale=scale,
                enable_gqa=True,
            )
            out[begin:end] = attended.squeeze(0).transpose(0, 1)
        return out
