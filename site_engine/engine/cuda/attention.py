"""The CUDA attention backend: two Triton kernels over the paged cache, nothing else.

A decode-only batch (one token per sequence) goes through the paged decode kernel. Any other
batch — fresh prompts, prompt chunks that continue cached positions (chunked prefill, recompute
after preemption), with decode rows mixed in — takes two launches per layer whatever its number
of sequences: the varlen paged kernel for the chunks of several tokens and the decode kernel,
in its flat mode, for the one-token chunks. No loop over sequences, no gather of cached K/V; both
read only device tensors, so either kind of batch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from site_engine.engine.attention import AttentionMetadata, write_kv_cache
from site_engine.engine.cuda.paged_decode import paged_decode_attention
from site_engine.engine.cuda.paged_prefill import paged_prefill_attention


class CudaPagedAttention:
    def __init__(self) -> None:
        self._decode_only = False

    def prepare(self, metadata: AttentionMetadata) -> None:
        self._decode_only = metadata.max_query_len == 1

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
        out, flat = None, None
        if not self._decode_only:
            # Chunks of several tokens: query tiles of the varlen kernel. One-token chunks (decode
            # rows) are left to the decode kernel's flat mode: its GQA rows, 16 per program, not
            # a 64-row query tile each.
            out = paged_prefill_attention(
                query,
                key_cache,
                value_cache,
                metadata.block_tables,
                metadata.query_start_loc,
                metadata.context_lens,
                num_tokens=metadata.num_tokens,
                scale=scale,
                sliding_window=sliding_window,
                skip_single=True,
            )
            flat = metadata.query_start_loc
        return paged_decode_attention(
            query,
            key_cache,
            value_cache,
            metadata.block_tables,
            metadata.context_lens,
            scale=scale,
            sliding_window=sliding_window,
            out=out,
            query_start_loc=flat,
        )
