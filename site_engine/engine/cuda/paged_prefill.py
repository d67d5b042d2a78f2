"""Attention for a flat batch of query chunks over the paged KV cache: one Triton launch.

Every chunk of a step — a whole fresh prompt, a prompt chunk that continues cached positions
(chunked prefill, recompute after preemption) or a single decode token — is served by the same
launch, with no per-sequence Python loop and no gather copy: each program reads its sequence's
K/V straight from the cache blocks named by the block table. The step's new K/V are written into
the cache before the launch, so "cached" and "new" positions are read alike.

Work split (the grid): one program per (query tile, KV head). A query tile is BLOCK_Q consecutive
query tokens of one sequence; its rows are those tokens times the GROUP query heads that share
the KV head (GQA), so each K/V tile is read once for the whole group and the matrix products
are BLOCK_M = BLOCK_Q * GROUP rows tall. Tiles never straddle sequences. The grid has a fixed
upper bound of `num_tokens // BLOCK_Q + num_seqs` tiles (sequence i's tiles start at global
index `query_start[i] // BLOCK_Q + i`), so the host computes no tile table: a program finds its
sequence by binary search over the cumulative query offsets, and programs past the end of their
sequence's chunk return at once. Programs take the tiles from the last one down: in a long
chunk the last tiles see the most positions, and starting them first keeps the tail short.

A tile walks its sequence's KV positions up to its own last query position, TILE positions at a
time, with an online softmax in float32 (FlashAttention-2's loop: queries outer, KV inner). The
positions every row of the tile sees (before the tile's first query, inside any sliding window)
take a loop with no mask at all; only the tiles on the causal diagonal (and at a window's lower
edge) pay for the masks. The softmax runs in base 2 with the scale folded into one multiply-add
per score, as FlashAttention does: at head_dim 64 the exponentials, not the matrix products,
bound a tile's time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# A window wider than any sequence: "no sliding window" without a branch in the kernel.
_NO_WINDOW = 1 << 30
_LOG2E = math.log2(math.e)


@dataclass(frozen=True, slots=True)
class PrefillTiles:
    """Tile shape and launch configuration of the varlen kernel."""

    block_m: int = 128  # rows of one program's matrix products (query tokens x GQA heads)
    tile: int = 64  # KV positions per loop iteration
    num_warps: int = 8
    num_stages: int = 2


def parse_tiles(spec: str) -> PrefillTiles:
    """'BLOCK_MxTILE:warps:stages', as the benches name configurations."""
    shape, warps, stages = spec.split(":")
    block_m, tile = (int(v) for v in shape.split("x"))
    return PrefillTiles(block_m, tile, int(warps), int(stages))


def default_tiles(head_dim: int) -> PrefillTiles:
    """The configuration measured fastest on an H100 at head_dim 64 over 2k-32k-token prompts
    (128 rows x 64 positions, 8 warps, 2 stages: bench/results/
    engine_prefill_long_h100_notes.md); head_dim 128 takes the same, unmeasured."""
    del head_dim
    return PrefillTiles()


@triton.jit
def _find_sequence(query_start_ptr, tile_index, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose tiles include global tile `tile_index`: the last i with
    query_start[i] // BLOCK_Q + i <= tile_index (a binary search over num_seqs + 1 entries)."""
    low = 0
    high = num_seqs
    while low < high:
        mid = (low + high + 1) // 2
        first_tile = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile_index:
            low = mid
        else:
            high = mid - 1
    return low


@triton.jit
def _past_the_chunks(query_start_ptr, tile_index, num_seqs, BLOCK_Q: tl.constexpr):
    """Whether global tile `tile_index` lies past every chunk's tiles, told with two loads.

    A captured step's grid is sized for its bucket: the token count padded up and max_num_seqs
    sequences, the unused ones with zero query tokens at the end. At the GPU default of 1,024
    sequences almost every program of a step is such a tile, and they start first (the grid
    runs from its top), so a binary search each would delay the real tiles. With T the step's
    real tokens (query_start[num_seqs]) and j = tile_index - T // BLOCK_Q: if sequence j - 1
    starts at T, it and every later one are empty, and every earlier sequence's tiles end at
    index (T - 1) // BLOCK_Q + j - 2 or before."""
    total = tl.load(query_start_ptr + num_seqs)
    j = tile_index - total // BLOCK_Q
    past = j > num_seqs
    if (j >= 1) & (j <= num_seqs):
        past = tl.load(query_start_ptr + j - 1) == total
    return past


@triton.jit
def _attend(
    acc, l_i, m_i, q, q_position, k_base, v_base, table_ptr, stride_block, stride_slot,
    start, stop, window, qk_scale,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, HEAD_DIM: tl.constexpr,
    PRECISION: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """Online softmax over KV positions [start, stop) of one sequence (start a multiple of
    TILE). MASKED: apply the causal and window masks and stop at `stop`; otherwise every row
    sees every position (the caller guarantees it). K and V share their strides (views of one
    cache tensor)."""
    offs_t = tl.arange(0, TILE)
    offs_d = tl.arange(0, HEAD_DIM)
    for kv_start in range(start, stop, TILE):
        pos = kv_start + offs_t
        if MASKED:
            kv_ok = pos < stop
            block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
        else:
            block = tl.load(table_ptr + pos // BLOCK_SIZE).to(tl.int64)
        rows = block[:, None] * stride_block + (pos % BLOCK_SIZE)[:, None] * stride_slot
        k_ptrs = k_base + rows
        v_ptrs = v_base + rows
        if MASKED:
            k = tl.load(k_ptrs + offs_d[None, :], mask=kv_ok[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs + offs_d[None, :])
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if MASKED:
            visible = (
                kv_ok[None, :]
                & (pos[None, :] <= q_position[:, None])
                & (pos[None, :] > q_position[:, None] - window)
            )
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1) * qk_scale)
            # A row that has seen nothing visible yet keeps m = -inf; subtract 0 instead, so
            # that exp2(-inf - -inf) never makes a NaN.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(scores, 1) * qk_scale)
            m_safe = m_new
        p = tl.math.exp2(scores * qk_scale - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_ptrs + offs_d[None, :], mask=kv_ok[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs + offs_d[None, :])
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


# Triton specializes integer arguments equal to 1 or divisible by 16; the batch size and the
# window change from step to step, and a recompilation inside a serving run costs seconds.
@triton.jit(do_not_specialize=["window", "num_seqs"])
def _paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_ptr, context_lens_ptr, out_ptr,
    qk_scale, window, num_seqs, long_from, long_context,
    stride_q_tok, stride_q_head,
    stride_kv_block, stride_kv_slot, stride_kv_head,
    stride_bt_seq,
    stride_o_tok, stride_o_head,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
    SKIP_SINGLE: tl.constexpr, SKIP_LONG: tl.constexpr, HAS_WINDOW: tl.constexpr,
):  # fmt: skip
    # The last (longest) tiles first. The KV head is the slow axis: with the heads fastest
    # (a step's programs spread over all heads' K/V at once) the kernel was 6-14% slower
    # (bench/results/engine_prefill/archive/engine_prefill_in_engine_h100_32000.md).
    tile_index = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    if _past_the_chunks(query_start_ptr, tile_index, num_seqs, BLOCK_Q):
        return
    seq = _find_sequence(query_start_ptr, tile_index, num_seqs - 1, BLOCK_Q)
    query_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - query_start
    local_tile = tile_index - (query_start // BLOCK_Q + seq)
    if local_tile * BLOCK_Q >= query_len:
        return
    if SKIP_SINGLE:  # noqa: SIM102 (a constexpr test on its own: Triton folds it away)
        if query_len == 1:
            return  # one-token chunks go to the decode kernel (GQA rows, not query tiles)
    context_len = tl.load(context_lens_ptr + seq)
    if SKIP_LONG:  # noqa: SIM102
        if (query_len >= long_from) & (context_len >= long_context):
            return  # long chunks go to cuDNN (cudnn_prefill.py)
    # Absolute position of the chunk's first query token: the cache holds every position before.
    first_position = context_len - query_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    query_in_chunk = local_tile * BLOCK_Q + offs_m // GROUP
    heads = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (query_in_chunk < query_len)
    q_position = first_position + query_in_chunk
    q_rows = (query_start + query_in_chunk).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_q_tok + heads[:, None] * stride_q_head + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    k_base = k_cache_ptr + kv_head * stride_kv_head
    v_base = v_cache_ptr + kv_head * stride_kv_head
    # The tile's queries sit at positions [tile_first, tile_last]. Causal: the last sees up to
    # itself. Positions before full_end are seen by every row (all <= tile_first).
    # (Scalar ifs rather than tl.minimum/maximum: Triton's CPU interpreter needs 0-d bounds.)
    tile_first = first_position + local_tile * BLOCK_Q
    end = tile_first + BLOCK_Q
    if end > context_len:
        end = context_len
    full_end = ((tile_first + 1) // TILE) * TILE
    full_start = 0
    if HAS_WINDOW:
        # A window w hides positions <= p - w from the query at p: the tile's first query needs
        # nothing before `low`; every row sees positions > tile_last - w.
        low = tile_first + 1 - window
        if low < 0:
            low = 0
        low = (low // TILE) * TILE
        full_start = ((end - window + TILE - 1) // TILE) * TILE  # first multiple >= end - w
        if full_start < low:
            full_start = low
        if full_start > full_end:
            full_start = full_end
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, q_position, k_base, v_base, table_ptr,
                                stride_kv_block, stride_kv_slot, low, full_start, window,
                                qk_scale, BLOCK_SIZE, TILE, HEAD_DIM, PRECISION, True)  # fmt: skip
    # Unmasked: the positions every row sees; then the masked diagonal.
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, q_position, k_base, v_base, table_ptr,
                            stride_kv_block, stride_kv_slot, full_start, full_end, window,
                            qk_scale, BLOCK_SIZE, TILE, HEAD_DIM, PRECISION, False)  # fmt: skip
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, q_position, k_base, v_base, table_ptr,
                            stride_kv_block, stride_kv_slot, full_end, end, window,
                            qk_scale, BLOCK_SIZE, TILE, HEAD_DIM, PRECISION, True)  # fmt: skip
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_o_tok + heads[:, None] * stride_o_head
        + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )  # fmt: skip


def query_tile_size(
    num_heads: int, num_kv_heads: int, tiles: PrefillTiles | None = None
) -> tuple[int, int]:
    """(BLOCK_Q query tokens per tile, BLOCK_M rows per program) for this head layout."""
    group = num_heads // num_kv_heads
    block_m = max((tiles or PrefillTiles()).block_m, triton.next_power_of_2(group))
    return max(1, block_m // group), block_m


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    num_tokens: int,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    skip_single: bool = False,
    skip_long: tuple[int, int] | None = None,
    tiles: PrefillTiles | None = None,
) -> torch.Tensor:
    """query [T, Hq, D] for the chunks of a step, their K/V already in the cache;
    caches [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks] int32;
    query_start_loc [B + 1] int32 (cumulative chunk lengths, chunk i = rows
    query_start_loc[i]:query_start_loc[i+1]); context_lens [B] int32 (KV length of each sequence
    after this step, so chunk i holds its last positions). `num_tokens` is T, known on the host.
    Returns [T, Hq, D]; with `skip_single` the rows of one-token chunks are left unwritten (for
    paged_decode_attention's flat mode, far cheaper for them than a query tile each); with
    `skip_long` (n, c) the rows of chunks of n tokens or more that end at c positions or more
    are left unwritten too (cudnn_prefill's path for long chunks)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_seqs = context_lens.shape[0]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    tiles = tiles or default_tiles(head_dim)
    block_q, block_m = query_tile_size(num_heads, num_kv_heads, tiles)
    tile = max(tiles.tile, block_size)
    if key_cache.stride() != value_cache.stride():
        raise ValueError("the K and V caches must share their layout (views of one cache)")
    if out is None:
        out = torch.empty_like(query)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _paged_prefill_kernel[grid](
        query, key_cache, value_cache, block_tables, query_start_loc, context_lens, out,
        scale * _LOG2E, sliding_window or _NO_WINDOW, num_seqs, *(skip_long or (_NO_WINDOW, 0)),
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, TILE=tile,
        # float32 gets exact float32 products (tf32 would change greedy choices).
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        SKIP_SINGLE=skip_single, SKIP_LONG=skip_long is not None,
        HAS_WINDOW=sliding_window is not None,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return out
