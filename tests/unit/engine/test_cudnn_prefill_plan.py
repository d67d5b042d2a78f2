"""The host side of the cuDNN path for long chunks: which chunks it takes and what it hands cuDNN
(lengths, ragged offsets, page tables, the blocks to gather), with no GPU."""

from __future__ import annotations

import torch

from site_engine.engine.attention import AttentionMetadata
from site_engine.engine.cuda.cudnn_prefill import (
    int32_offsets_fit,
    is_whole_chunk,
    plan_long_chunks,
)

BLOCK = 16


def _metadata(chunks: list[tuple[int, int]], tables: list[list[int]]) -> AttentionMetadata:
    starts = [0]
    for _, new in chunks:
        starts.append(starts[-1] + new)
    contexts = [cached + new for cached, new in chunks]
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]
    unused = torch.empty(0, dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=unused,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        context_lens=torch.tensor(contexts, dtype=torch.int32),
        block_tables=torch.tensor(padded, dtype=torch.int32),
        max_query_len=max(n for _, n in chunks),
        max_context_len=max(contexts),
        query_start_loc_host=tuple(starts),
        context_lens_host=tuple(contexts),
    )


def _table(first: int, context: int) -> list[int]:
    return list(range(first, first + -(-context // BLOCK)))


def test_only_chunks_long_in_both_senses_are_taken() -> None:
    # (cached, new): long and deep; short; a decode row; long but shallow; long and deep.
    chunks = [(100, 300), (0, 20), (500, 1), (0, 200), (1000, 129)]
    tables = [_table(1000 * i, c + n) for i, (c, n) in enumerate(chunks)]
    plan = plan_long_chunks(_metadata(chunks, tables), min_tokens=128, min_context=250,
                            block_size=BLOCK, gather=True)  # fmt: skip
    assert plan is not None
    assert plan.rows == (0, 4)
    assert plan.query_starts.flatten().tolist() == [0, 521, 650]  # each chunk's start, then end
    assert plan.seq_len_q.flatten().tolist() == [300, 129]
    assert plan.seq_len_kv.flatten().tolist() == [400, 1129]
    assert plan.query_bucket == 512  # the longest chunk, up to a power of two
    assert plan.page_bucket == 128  # 71 blocks for 1,129 positions, up to a power of two
    assert plan.tables.shape == (2, 1, 128, 1)
    assert plan.tables[0, 0, :25, 0].tolist() == tables[0]
    assert plan.tables[0, 0, 25:, 0].eq(0).all()
    assert plan.tables[1, 0, :71, 0].tolist() == tables[4]
    # Gathered mode: every block of both contexts in order, chunk after chunk.
    assert plan.gather_blocks is not None
    assert plan.kv_starts is not None
    assert plan.gather_blocks.tolist() == tables[0] + tables[4]
    assert plan.kv_starts.flatten().tolist() == [0, 25 * BLOCK, (25 + 71) * BLOCK]
    assert (plan.min_tokens, plan.min_context) == (128, 250)
    assert plan.shapes == ((0, 300, 400), (521, 129, 1129))  # (first row, new, context)


def test_whole_chunks_are_those_of_repeating_shapes() -> None:
    """Full 8,192-token chunks of a long prompt prefilled alone get exact-dims graphs; a last
    chunk, or one shortened by decode rows beside it, does not."""
    assert is_whole_chunk(8192, 8192)
    assert is_whole_chunk(8192, 24576)
    assert not is_whole_chunk(7424, 32000)
    assert not is_whole_chunk(8150, 16384)


def test_a_step_without_long_chunks_plans_nothing() -> None:
    chunks = [(0, 100), (5000, 1), (10, 127)]
    tables = [_table(100 * i, c + n) for i, (c, n) in enumerate(chunks)]
    assert plan_long_chunks(_metadata(chunks, tables), 128, 0, BLOCK) is None
    # Long enough, but no context reaches the depth asked for.
    assert plan_long_chunks(_metadata([(0, 300)], [_table(0, 300)]), 128, 301, BLOCK) is None


def test_paged_mode_gathers_nothing() -> None:
    plan = plan_long_chunks(_metadata([(0, 300)], [_table(7, 300)]), 128, 0, BLOCK)
    assert plan is not None
    assert plan.gather_blocks is None
    assert plan.kv_starts is None
    assert plan.page_bucket == 64  # the smallest bucket
    assert plan.query_bucket == 512


def test_offsets_past_int32_go_to_the_triton_kernel() -> None:
    """cuDNN's ragged offsets and page tables are int32 element counts: a step whose query rows,
    gathered contexts or (paged mode) cache reach 2^31 elements is left to the Triton kernel,
    which indexes in 64 bits. Shapes only (meta tensors): the sizes are those of real models."""
    chunks = [(0, 4096), (8192, 4096)]  # two long chunks, the second one continuing a prefix
    plan = plan_long_chunks(_metadata(chunks, [_table(0, 4096), _table(300, 12288)]), 4096,
                            4096, BLOCK, gather=True)  # fmt: skip
    assert plan is not None
    # An 8B model's rows: fused QKV of 32 + 2 x 8 heads of 128 (the query is a view of them).
    query = torch.empty_strided((8192, 32, 128), (6144, 128, 1), device="meta")
    out = torch.empty((8192, 32, 128), device="meta")
    cache = torch.empty((100_000, BLOCK, 8, 128), device="meta")
    assert int32_offsets_fit(plan, query, out, cache, gather=True)
    assert int32_offsets_fit(plan, query, out, cache, gather=False)
    # 8,192 rows of 2^18 elements each: 2^31 at the last row.
    wide = torch.empty_strided((8192, 32, 128), (1 << 18, 128, 1), device="meta")
    assert not int32_offsets_fit(plan, wide, out, cache, gather=True)
    # Paged mode reads the whole cache: 2^31 / (16 x 8 x 128) = 131,072 blocks is past it.
    for blocks, fits in ((131_071, True), (131_072, False)):
        paged = torch.empty((blocks, BLOCK, 8, 128), device="meta")
        assert int32_offsets_fit(plan, query, out, paged, gather=False) is fits
    # Gathered: the contexts' 4,096 + 12,288 positions x 8 x 128 fit; with heads of 2^14
    # elements (2^17 a position) they do not.
    huge_heads = torch.empty((100, BLOCK, 8, 1 << 14), device="meta")
    assert not int32_offsets_fit(plan, query, out, huge_heads, gather=True)
