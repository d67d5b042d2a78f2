"""The CUDA attention backend: two Triton kernels over the paged cache, and cuDNN for long chunks.

A decode-only batch (one token per sequence) goes through the paged decode kernel. Any other
batch — fresh prompts, prompt chunks that continue cached positions (chunked prefill, recompute
after preemption), with decode rows mixed in — takes two launches per layer whatever its number
of sequences: the varlen paged kernel for the chunks of several tokens and the decode kernel,
in its flat mode, for the one-token chunks. No loop over sequences, no gather of cached K/V; both
read only device tensors, so either kind of batch can be captured in a CUDA graph.

Chunks of at least `CudnnLongPrefill.min_tokens` tokens (long prompts) go to cuDNN's fused
attention instead (cudnn_prefill.py says why), one more launch per layer; the Triton kernel
skips them. Such a step is never captured: `needs_eager` tells the runner so.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from site_engine.engine.attention import AttentionMetadata, write_kv_cache
from site_engine.engine.cuda.cudnn_prefill import CudnnLongPrefill, LongChunkPlan
from site_engine.engine.cuda.paged_decode import paged_decode_attention
from site_engine.engine.cuda.paged_prefill import paged_prefill_attention


class CudaPagedAttention:
    def __init__(self, long_prefill: CudnnLongPrefill | None = None) -> None:
        self._decode_only = False
        self.long_prefill = long_prefill
        self._metadata: AttentionMetadata | None = None
        self._plan: LongChunkPlan | None = None
        self._planned = False

    def needs_eager(self, chunks: Sequence[tuple[int, int]]) -> bool:
        """A step whose chunks include one for cuDNN: its shapes cannot be captured."""
        long_prefill = self.long_prefill
        return long_prefill is not None and any(long_prefill.takes(n, c) for n, c in chunks)

    def describe(self) -> str:
        kernels = "attention: Triton paged kernels"
        if self.long_prefill is None:
            return f"{kernels}, long chunks too (no cuDNN frontend, or not a half-precision model)"
        return f"{kernels}; {self.long_prefill.describe()}"

    def close(self) -> None:
        self._metadata = self._plan = None
        if self.long_prefill is not None:
            self.long_prefill.close()

    def prepare(self, metadata: AttentionMetadata) -> None:
        self._decode_only = metadata.max_query_len == 1
        # A captured step's host tuples are bounds, not its chunks: no cuDNN plan for them.
        self._metadata = None if metadata.for_graph else metadata
        self._plan, self._planned = None, False

    def _long_plan(self, key_cache: torch.Tensor) -> LongChunkPlan | None:
        """The step's long chunks, planned at its first layer (the cache's block size is known
        there)."""
        if not self._planned:
            self._planned = True
            if self.long_prefill is not None and self._metadata is not None:
                self._plan = self.long_prefill.plan(self._metadata, key_cache.shape[1])
        return self._plan

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
            plan = None
            if self.long_prefill is not None and self.long_prefill.supports(
                query, key_cache, sliding_window
            ):
                plan = self._long_plan(key_cache)
            if plan is not None:
                out = torch.empty_like(query)
                assert self.long_prefill is not None
                if not self.long_prefill.run(query, key_cache, value_cache, out, plan,
                                             scale=scale):  # fmt: skip
                    plan = None  # no cuDNN plan for this shape: the Triton kernel takes them
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
                out=out,
                skip_single=True,
                skip_long=(plan.min_tokens, plan.min_context) if plan is not None else None,
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
