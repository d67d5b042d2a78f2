"""Reference paged attention against dense attention computed by hand."""

from __future__ import annotations

import pytest
import torch

from site_engine.engine.attention import AttentionMetadata, TorchReferenceAttention

BLOCK_SIZE = 3
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None
) -> torch.Tensor:
    """q: [n, H, D] for the last n of k/v's [ctx, Hkv, D] positions; a plain softmax loop."""
    n, ctx = q.shape[0], k.shape[0]
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    out = torch.empty_like(q)
    for j in range(n):
        pos = ctx - n + j
        lo = 0 if window is None else max(0, pos - window + 1)
        scores = torch.einsum("hd,khd->hk", q[j], k[lo : pos + 1]) * HEAD_DIM**-0.5
        out[j] = torch.einsum("hk,khd->hd", scores.softmax(-1), v[lo : pos + 1])
    return out


@pytest.mark.parametrize("window", [None, 4])
def test_reference_matches_dense(window: int | None) -> None:
    torch.manual_seed(0)
    # (cached positions, new tokens, block table): a decode, a fresh prefill, a second chunk.
    seqs = [(7, 1, [5, 0, 9]), (0, 5, [2, 7]), (4, 4, [8, 1, 4])]
    num_blocks = 10
    key_cache = torch.zeros(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    value_cache = torch.zeros_like(key_cache)
    full_k = [torch.randn(c + n, KV_HEADS, HEAD_DIM) for c, n, _ in seqs]
    full_v = [torch.randn(c + n, KV_HEADS, HEAD_DIM) for c, n, _ in seqs]
    slots, q_rows = [], []
    for (cached, new, table), k, v in zip(seqs, full_k, full_v, strict=True):
        for pos in range(cached + new):
            block, offset = table[pos // BLOCK_SIZE], pos % BLOCK_SIZE
            if pos < cached:
                key_cache[block, offset], value_cache[block, offset] = k[pos], v[pos]
            else:
                slots.append(block * BLOCK_SIZE + offset)
        q_rows.append(torch.randn(new, HEADS, HEAD_DIM))
    starts = [0, 1, 6, 10]
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        context_lens=torch.tensor([8, 5, 8], dtype=torch.int32),
        block_tables=torch.tensor([[5, 0, 9], [2, 7, 0], [8, 1, 4]], dtype=torch.int32),
        max_query_len=5,
        max_context_len=8,
        query_start_loc_host=tuple(starts),
        context_lens_host=(8, 5, 8),
    )
    new_k = torch.cat([k[c:] for (c, _, _), k in zip(seqs, full_k, strict=True)])
    new_v = torch.cat([v[c:] for (c, _, _), v in zip(seqs, full_v, strict=True)])
    out = TorchReferenceAttention().forward(
        torch.cat(q_rows),
        new_k,
        new_v,
        key_cache,
        value_cache,
        metadata,
        scale=HEAD_DIM**-0.5,
        sliding_window=window,
    )
    expected = torch.cat(
        [dense_attention(q, k, v, window) for q, k, v in zip(q_rows, full_k, full_v, strict=True)]
    )
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(key_cache.view(-1, KV_HEADS, HEAD_DIM)[slots], new_k)
