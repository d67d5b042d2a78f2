"""The CUDA attention backend: the Triton paged kernel for decode tokens, flash attention for
fresh prompts, the reference path only for prompts that continue from cached positions.

The runner hands this backend either a decode-only batch (one token per sequence; this is the
part captured in CUDA graphs, so it reads only device tensors) or a prefill batch.
"""

from __future__ import annotations

import torch

from site_engine.engine.attention import (
    AttentionMetadata,
    TorchReferenceAttention,
    write_kv_cache,
)
from site_engine.engine.cuda.paged_decode import paged_decode_attention


class CudaPagedAttention:
    def __init__(self) -> None:
        self._reference = TorchReferenceAttention()
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
        if self._decode_only:
            write_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
            return paged_decode_attention(
                query,
                key_cache,
                value_cache,
                metadata.block_tables,
                metadata.context_lens,
                scale=scale,
                sliding_window=sliding_window,
            )
        return self._prefill(query, key, value, key_cache, value_cache, metadata, scale,
                             sliding_window)  # fmt: skip

    def _prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        starts, contexts = metadata.query_start_loc_host, metadata.context_lens_host
        fresh = all(contexts[i] == starts[i + 1] - starts[i] for i in range(metadata.num_seqs))
        if not fresh or sliding_window is not None:
            # Some chunk continues cached positions (chunked prefill, recompute): gather path.
            return self._reference.forward(query, key, value, key_cache, value_cache, metadata,
                                           scale=scale, sliding_window=sliding_window)  # fmt: skip
        write_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
        out = torch.empty_like(query)
        for i in range(metadata.num_seqs):
            begin, end = starts[i], starts[i + 1]
            # Whole prompt, nothing cached before it: plain causal attention on its own K/V.
            out[begin:end] = (
                torch.nn.functional.scaled_dot_product_attention(
                    query[begin:end].transpose(0, 1).unsqueeze(0),
                    key[begin:end].transpose(0, 1).unsqueeze(0),
                    value[begin:end].transpose(0, 1).unsqueeze(0),
                    is_causal=True,
                    scale=scale,
                    enable_gqa=True,
                )
                .squeeze(0)
                .transpose(0, 1)
            )
        return out
