"""The Triton paged decode kernel against the reference attention, on random caches.

Fresh random inputs for every case; block tables shuffled so sequences are scattered over the
cache; the output is poisoned first so an unwritten element cannot pass.
"""

from __future__ import annotations

import pytest
import torch

from site_engine.engine.attention import AttentionMetadata
from tests.gpu.kernel_device import assert_matches_reference, skip_bf16_in_interpreter

pytestmark = pytest.mark.gpu

CASES = [
    # (num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_context, window, dtype)
    (1, 32, 8, 64, 16, 17, None, torch.bfloat16),
    (7, 32, 8, 64, 16, 700, None, torch.bfloat16),
    (33, 16, 16, 128, 16, 300, None, torch.bfloat16),
    (5, 14, 2, 64, 32, 257, None, torch.float16),
    (9, 8, 2, 64, 16, 200, 37, torch.bfloat16),
    (6, 8, 8, 64, 16, 130, None, torch.float32),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_kernel_matches_reference(case, kernel_device: str) -> None:
    from site_engine.engine.cuda.paged_decode import paged_decode_attention

    seqs, heads, kv_heads, dim, block, max_ctx, window, dtype = case
    skip_bf16_in_interpreter(kernel_device, dtype)
    generator = torch.Generator(device="cpu").manual_seed(hash(case) % 2**31)
    context = torch.randint(1, max_ctx + 1, (seqs,), generator=generator)
    blocks_per_seq = -(-max_ctx // block)
    num_blocks = seqs * blocks_per_seq + 3
    order = torch.randperm(num_blocks, generator=generator)[: seqs * blocks_per_seq]
    tables = order.view(seqs, blocks_per_seq).to(torch.int32).to(kernel_device)
    k_cache = (
        torch.randn(num_blocks, block, kv_heads, dim, generator=generator)
        .to(dtype)
        .to(kernel_device)
    )
    v_cache = (
        torch.randn(num_blocks, block, kv_heads, dim, generator=generator)
        .to(dtype)
        .to(kernel_device)
    )
    query = torch.randn(seqs, heads, dim, generator=generator).to(dtype).to(kernel_device)
    scale = dim**-0.5
    out = torch.full_like(query, float("nan"))
    lens = context.to(torch.int32).to(kernel_device)
    paged_decode_attention(query, k_cache, v_cache, tables, lens, scale=scale,
                           sliding_window=window, out=out)  # fmt: skip

    # Reference: same cache contents; its write of the "new" token is a no-op rewrite.
    last = context - 1
    slots = tables.cpu().long()[torch.arange(seqs), last // block] * block + last % block
    metadata = AttentionMetadata(
        slot_mapping=slots.to(kernel_device),
        query_start_loc=torch.arange(seqs + 1, dtype=torch.int32).to(kernel_device),
        context_lens=context.to(torch.int32).to(kernel_device),
        block_tables=tables,
        max_query_len=1,
        max_context_len=int(context.max()),
        query_start_loc_host=tuple(range(seqs + 1)),
        context_lens_host=tuple(int(c) for c in context),
    )
    assert_matches_reference(out, query, k_cache, v_cache, metadata, scale=scale, window=window)
