"""The Triton varlen paged attention (prefill chunks of many sequences in one launch) against a
float64 reference on random scattered caches.

Each case mixes chunk kinds in one flat batch: whole fresh prompts, chunks that continue cached
positions (chunked prefill, recompute) and single decode tokens. Block tables are shuffled so
sequences are scattered over the cache, inputs are fresh random numbers for every case, and the
output is poisoned first so an unwritten element cannot pass.
"""

from __future__ import annotations

import pytest
import torch

from site_engine.engine.attention import AttentionMetadata
from tests.gpu.kernel_device import assert_matches_reference, skip_bf16_in_interpreter

pytestmark = pytest.mark.gpu

CASES = [
    # (chunks as (cached, new) positions, heads, kv_heads, head_dim, block_size, window, dtype)
    (((0, 37), (0, 5), (90, 1), (16, 64), (0, 1)), 32, 8, 64, 16, None, torch.bfloat16),
    (((300, 200), (0, 333), (47, 1), (700, 1), (5, 130)), 32, 8, 64, 16, None, torch.bfloat16),
    (((0, 70), (33, 50), (128, 1)), 16, 16, 128, 16, None, torch.bfloat16),
    (((0, 40), (61, 29), (100, 1), (3, 3)), 14, 2, 64, 32, None, torch.float16),
    (((0, 90), (120, 45), (150, 1)), 8, 2, 64, 16, 37, torch.bfloat16),
    (((0, 33), (40, 25), (60, 1), (17, 2)), 8, 8, 64, 16, None, torch.float32),
    # Long cached prefixes: many unmasked KV tiles before the diagonal, several query tiles.
    (((1000, 200), (0, 300), (777, 1)), 32, 8, 64, 16, None, torch.float16),
    (((500, 100), (0, 129)), 16, 4, 128, 16, None, torch.float16),
    (((2100, 300), (4000, 1)), 32, 8, 64, 16, None, torch.bfloat16),
    # A window inside a long context: masked lower edge, unmasked middle, masked diagonal.
    (((0, 150), (200, 90), (300, 1), (61, 70)), 8, 2, 64, 16, 40, torch.float16),
    (((600, 200), (0, 300)), 32, 8, 64, 16, 129, torch.float32),
]


def _metadata(chunks, tables, block, device) -> AttentionMetadata:
    lens = [new for _, new in chunks]
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    contexts = [cached + new for cached, new in chunks]
    positions = torch.cat([torch.arange(c, c + n) for c, n in chunks])
    seq_of = torch.repeat_interleave(torch.arange(len(chunks)), torch.tensor(lens))
    slots = tables.cpu().long()[seq_of, positions // block] * block + positions % block
    return AttentionMetadata(
        slot_mapping=slots.to(device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        context_lens=torch.tensor(contexts, dtype=torch.int32, device=device),
        block_tables=tables,
        max_query_len=max(lens),
        max_context_len=max(contexts),
        query_start_loc_host=tuple(starts),
        context_lens_host=tuple(contexts),
    )


def _random_inputs(case, seed: int, device: str):
    """(query, k_cache, v_cache, tables, metadata) for a case: fresh random numbers, block
    tables shuffled over a cache with spare blocks."""
    chunks, heads, kv_heads, dim, block, _, dtype = case
    generator = torch.Generator(device="cpu").manual_seed(seed)
    max_ctx = max(c + n for c, n in chunks)
    blocks_per_seq = -(-max_ctx // block)
    num_blocks = len(chunks) * blocks_per_seq + 3
    order = torch.randperm(num_blocks, generator=generator)[: len(chunks) * blocks_per_seq]
    tables = order.view(len(chunks), blocks_per_seq).to(torch.int32).to(device)
    shape = (num_blocks, block, kv_heads, dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype).to(device)
    v_cache = torch.randn(shape, generator=generator).to(dtype).to(device)
    num_tokens = sum(n for _, n in chunks)
    query = torch.randn(num_tokens, heads, dim, generator=generator).to(dtype).to(device)
    return query, k_cache, v_cache, tables, _metadata(chunks, tables, block, device)


@pytest.mark.parametrize(
    "case",
    CASES,
    ids=lambda c: f"{len(c[0])}seqs-{c[1]}-{c[2]}-{c[3]}-{c[4]}-{c[5]}-{c[6]}".replace(
        "torch.", ""
    ),
)
@pytest.mark.parametrize("split", [False, True], ids=["varlen", "split"])
def test_kernel_matches_reference(case, split: bool, kernel_device: str) -> None:
    """varlen: the varlen kernel computes every row; split: as the CUDA backend runs a step, the
    varlen kernel skips one-token chunks and the decode kernel's flat mode computes them."""
    from site_engine.engine.cuda.paged_decode import paged_decode_attention
    from site_engine.engine.cuda.paged_prefill import paged_prefill_attention

    chunks, heads, _, dim, _, window, dtype = case
    skip_bf16_in_interpreter(kernel_device, dtype)
    query, k_cache, v_cache, tables, metadata = _random_inputs(
        case, sum(c + n for c, n in chunks) + heads, kernel_device
    )
    num_tokens = query.shape[0]
    scale = dim**-0.5
    out = torch.full_like(query, float("nan"))
    paged_prefill_attention(
        query, k_cache, v_cache, tables, metadata.query_start_loc, metadata.context_lens,
        num_tokens=num_tokens, scale=scale, sliding_window=window, out=out, skip_single=split,
    )  # fmt: skip
    if split:
        starts = metadata.query_start_loc_host[:-1]
        single = [q for q, (_, n) in zip(starts, chunks, strict=True) if n == 1]
        assert torch.isnan(out[single]).all()  # the varlen kernel left them to the other
        paged_decode_attention(
            query, k_cache, v_cache, tables, metadata.context_lens, scale=scale,
            sliding_window=window, out=out, query_start_loc=metadata.query_start_loc,
        )  # fmt: skip

    assert_matches_reference(out, query, k_cache, v_cache, metadata, scale=scale, window=window)


@pytest.mark.parametrize("padding", [(0, 7), (45, 300)], ids=["seqs-only", "tokens-and-seqs"])
def test_a_captured_steps_padding_changes_nothing(padding, kernel_device: str) -> None:
    """As a flat step graph launches it: the token rows padded up to the bucket, belonging to
    no sequence, and the sequence arrays padded with sequences of zero query tokens (with stale
    context lengths and tables). The real rows match the reference and the padded rows stay
    unwritten; the padding programs exit before the sequence search (`_past_the_chunks`)."""
    from site_engine.engine.cuda.paged_prefill import paged_prefill_attention

    extra_tokens, extra_seqs = padding
    case = CASES[1]
    _, heads, _, dim, _, window, _ = case
    dtype = torch.float16 if kernel_device == "cpu" else torch.bfloat16
    query, k_cache, v_cache, tables, metadata = _random_inputs(
        (*case[:-1], dtype), 11 + extra_seqs, kernel_device
    )
    real = query.shape[0]
    generator = torch.Generator(device="cpu").manual_seed(extra_tokens)
    padded_query = torch.cat(
        [query, torch.randn(extra_tokens, heads, dim, generator=generator).to(query)]
    )
    starts = torch.cat([metadata.query_start_loc, metadata.query_start_loc[-1:].repeat(extra_seqs)])
    stale_contexts = torch.randint(1, 500, (extra_seqs,), generator=generator, dtype=torch.int32)
    contexts = torch.cat([metadata.context_lens, stale_contexts.to(kernel_device)])
    padded_tables = torch.cat([tables, tables[:1].repeat(extra_seqs, 1)])
    out = torch.full_like(padded_query, float("nan"))
    paged_prefill_attention(
        padded_query, k_cache, v_cache, padded_tables, starts, contexts,
        num_tokens=real + extra_tokens, scale=dim**-0.5, sliding_window=window, out=out,
    )  # fmt: skip
    assert torch.isnan(out[real:]).all()
    assert_matches_reference(
        out[:real], query, k_cache, v_cache, metadata, scale=dim**-0.5, window=window
    )
