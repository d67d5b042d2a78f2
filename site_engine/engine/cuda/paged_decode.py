"""Decode attention over the paged KV cache: one Triton kernel, no gather, no padding.

One program per (sequence, KV head) handles all the query heads that share that KV head (GQA),
so every K/V tile is read from HBM once per group rather than once per query head. It walks the
sequence's block table TILE tokens at a time with an online softmax in float32. The loop bound
comes from the sequence's context length on the device, so the launch has a fixed grid and can
be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tokens per loop iteration: several KV blocks at once keeps enough loads in flight.
_TILE = 64


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, query_start_ptr, out_ptr,
    scale, sliding_window,
    stride_q_tok, stride_q_head,
    stride_k_block, stride_k_slot, stride_k_head,
    stride_v_block, stride_v_slot, stride_v_head,
    stride_bt_seq,
    stride_o_tok, stride_o_head,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr, FLAT: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    row = seq.to(tl.int64)
    if FLAT:
        # A flat batch of chunks: serve only the one-token chunks, at their row of the batch.
        row_start = tl.load(query_start_ptr + seq)
        if tl.load(query_start_ptr + seq + 1) - row_start != 1:
            return
        row = row_start.to(tl.int64)
    context_len = tl.load(context_lens_ptr + seq)
    row_table = seq.to(tl.int64) * stride_bt_seq
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_t = tl.arange(0, TILE)
    heads = kv_head * GROUP + offs_g
    head_ok = offs_g < GROUP
    q = tl.load(
        q_ptr + row * stride_q_tok + heads[:, None] * stride_q_head + offs_d[None, :],
        mask=head_ok[:, None],
        other=0.0,
    )
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    # With a sliding window w the query at position context_len - 1 sees positions > ctx-1-w.
    first = tl.where(sliding_window > 0, tl.maximum(context_len - sliding_window, 0), 0)
    start = (first // TILE) * TILE
    for tile_start in range(start, context_len, TILE):
        pos = tile_start + offs_t
        valid = (pos < context_len) & (pos >= first)
        # 64-bit: block x stride passes 2^31 elements once a layer's cache holds more than
        # 2^31 / (block_size x kv_heads x head_dim) blocks (1,048,576 at 16 x 2 x 64), and an
        # int32 product wraps to another block's data or before the cache (docs/engine-gpu.md).
        block = tl.load(block_tables_ptr + row_table + pos // BLOCK_SIZE, mask=valid, other=0)
        block = block.to(tl.int64)
        slot = pos % BLOCK_SIZE
        k = tl.load(
            k_cache_ptr + block[:, None] * stride_k_block + slot[:, None] * stride_k_slot
            + kv_head * stride_k_head + offs_d[None, :],
            mask=valid[:, None], other=0.0,
        )  # fmt: skip
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + block[:, None] * stride_v_block + slot[:, None] * stride_v_slot
            + kv_head * stride_v_head + offs_d[None, :],
            mask=valid[:, None], other=0.0,
        )  # fmt: skip
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + row * stride_o_tok + heads[:, None] * stride_o_head + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=head_ok[:, None],
    )


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [B, Hq, D] (one token per sequence, its K/V already in the cache);
    caches [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks] int32;
    context_lens [B] int32 (>= 1). Returns [B, Hq, D].

    With `query_start_loc` [B + 1] int32, `query` is instead the flat batch of a step whose
    chunk i holds rows query_start_loc[i]:query_start_loc[i + 1]: only the rows of one-token
    chunks are computed (written into `out`), the others are left to the varlen kernel."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_seqs = context_lens.shape[0]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    _paged_decode_kernel[(num_seqs, num_kv_heads)](
        query, key_cache, value_cache, block_tables, context_lens,
        query_start_loc if query_start_loc is not None else context_lens, out,
        scale, sliding_window or 0,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, TILE=max(_TILE, block_size),
        # float32 caches get exact float32 products (tf32 would change greedy choices).
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        FLAT=query_start_loc is not None,
    )  # fmt: skip
    return out
