"""A KV pool whose blocks lie past 2^31 elements of a layer's cache: every block reads its own K/V.

Why (issue 59): the engine died on an H200 with a small Llama (2 KV heads of 64, blocks of 16
tokens, so 2,048 elements a block in each layer's K or V view) and 1,024 sequences, whose
auto-sized pool held millions of blocks. The decode kernel multiplied int32 block ids by the
block stride in int32: a block id b >= 2^31 / 2,048 = 1,048,576 wraps, to an offset up to 4 GiB
before the cache (b mod 2^21 >= 2^20: outside the allocation for layer 0's keys, an illegal
address) or to another block's data (silently wrong attention). Padding rows of the CUDA graphs
read the scratch block N (= num_blocks) during warm-up, which is why the engine died at start.

Device command (one call, nothing carried; ~1-2 minutes on an H100, 43 GB of its memory):
`python3 -m pytest -q -m gpu tests/gpu/test_kv_pool_offsets.py`.
On the code before the fix the runner test fails: a CUDA illegal memory access in the decode
graphs' warm-up, or tokens of the high blocks that differ from the low blocks'. Run it alone:
an illegal access poisons the CUDA context of every later test in the process.

The kernel test also runs on the CPU through Triton's interpreter,
`TRITON_INTERPRET=1 python -m pytest -q -m gpu tests/gpu/test_kv_pool_offsets.py -k kernels`
(see tests/gpu/kernel_device.py for the environment): its 8.6 GB cache is only reserved there,
never touched but for the blocks the test writes, and it uses only blocks whose wrapped int32
offset stays inside the cache (a wrong read, not a segfault of the test process).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from site_engine.engine.attention import AttentionMetadata
from site_engine.engine.core.types import SamplingParams, ScheduledChunk
from site_engine.engine.model_runner import ModelRunner
from site_engine.make_model import build_random_model
from tests.gpu.kernel_device import assert_matches_reference

pytestmark = pytest.mark.gpu

BLOCK, KV_HEADS, HEAD_DIM, HEADS = 16, 2, 64, 8
STRIDE = BLOCK * KV_HEADS * HEAD_DIM  # elements of one block in one layer's K (or V) view
FIRST_WRAPPED = 2**31 // STRIDE  # 1,048,576: the first block whose int32 offset wraps
INSIDE_AGAIN = 2**32 // STRIDE  # 2,097,152: wrapped offsets >= 0 again (another block)


def _kernel_blocks(count: int, device: str) -> list[int]:
    """Distinct block ids past 2^31 elements: on the GPU half of them where an int32 offset
    would be negative, on the CPU only where it would land inside the cache."""
    inside = [INSIDE_AGAIN + 7 * i for i in range(count)]
    if device == "cpu":
        return inside
    before = [FIRST_WRAPPED + 4099 * i + 3 for i in range(count // 2)]
    return before + inside[: count - len(before)]


def _metadata(chunks, tables, device) -> AttentionMetadata:
    lens = [new for _, new in chunks]
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    contexts = [cached + new for cached, new in chunks]
    positions = torch.cat([torch.arange(c, c + n) for c, n in chunks])
    seq_of = torch.repeat_interleave(torch.arange(len(chunks)), torch.tensor(lens))
    slots = tables.cpu().long()[seq_of, positions // BLOCK] * BLOCK + positions % BLOCK
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


def _attend(query, cache, metadata, decode_only: bool) -> torch.Tensor:
    """The engine's CUDA attention over `cache` (K and V both: one view keeps the CPU's
    reservation at 8.6 GB), the K/V of the step already in it."""
    from site_engine.engine.cuda.paged_decode import paged_decode_attention
    from site_engine.engine.cuda.paged_prefill import paged_prefill_attention

    out = torch.full_like(query, float("nan"))
    flat = None
    if not decode_only:
        paged_prefill_attention(
            query, cache, cache, metadata.block_tables, metadata.query_start_loc,
            metadata.context_lens, num_tokens=metadata.num_tokens, scale=HEAD_DIM**-0.5,
            out=out, skip_single=True,
        )  # fmt: skip
        flat = metadata.query_start_loc
    return paged_decode_attention(
        query, cache, cache, metadata.block_tables, metadata.context_lens,
        scale=HEAD_DIM**-0.5, out=out, query_start_loc=flat,
    )  # fmt: skip


# (cached, new) positions of each chunk: decode rows alone, then a mixed flat batch.
STEPS = [
    ((40, 1), (0, 1), (70, 1), (16, 1)),
    ((0, 37), (20, 5), (30, 1), (50, 1)),
]


@pytest.mark.parametrize("chunks", STEPS, ids=["decode", "mixed"])
def test_kernels_read_blocks_past_2_31_elements(chunks, kernel_device: str) -> None:
    device = kernel_device
    dtype = torch.float16
    per_seq = -(-max(c + n for c, n in chunks) // BLOCK)
    used = len(chunks) * per_seq
    high = _kernel_blocks(used, device)
    generator = torch.Generator(device="cpu").manual_seed(59)
    data = torch.randn(used, BLOCK, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
    tokens = sum(n for _, n in chunks)
    query = torch.randn(tokens, HEADS, HEAD_DIM, generator=generator).to(dtype).to(device)
    # The same blocks twice: at ids 0..used-1 of a small cache, and at the high ids of a cache
    # with more than 2^32 elements (empty: only the written blocks are ever touched).
    small = data.to(device)
    big = torch.empty(max(high) + 1, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    big[torch.tensor(high, device=device)] = small
    assert big.stride(0) * max(high) >= 2**32
    low_tables = torch.arange(used, dtype=torch.int32).view(len(chunks), per_seq).to(device)
    high_tables = torch.tensor(high, dtype=torch.int32).view(len(chunks), per_seq).to(device)
    decode_only = all(new == 1 for _, new in chunks)
    low_meta = _metadata(chunks, low_tables, device)
    expected = _attend(query, small, low_meta, decode_only)
    assert_matches_reference(expected, query, small, small, low_meta, scale=HEAD_DIM**-0.5,
                             window=None)  # fmt: skip
    got = _attend(query, big, _metadata(chunks, high_tables, device), decode_only)
    assert torch.equal(got, expected), (got - expected).abs().max()


# The model with one layer instead of four (the offsets inside a layer's view are the
# same; four layers of 5.2M blocks would not fit an H100) and a pool of 5,242,880 blocks, more
# than the H200's: (N x 2,048) mod 2^32 = 2^31, so the graphs' scratch block N sits exactly
# 2^31 elements (4 GiB) before the cache in int32, as the H200's did.
POOL_BLOCKS = 5_242_880
SEQS, PROMPT, DECODE_STEPS = 1024, 8, 12
CONFIG = LlamaConfig(
    hidden_size=HEADS * HEAD_DIM, intermediate_size=1024, num_hidden_layers=1,
    num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=128256,
    max_position_embeddings=2048, initializer_range=0.2, bos_token_id=None, eos_token_id=None,
    pad_token_id=None,
)  # fmt: skip
GREEDY = SamplingParams(max_tokens=DECODE_STEPS + 1, temperature=0.0, ignore_eos=True)


def _generate(
    runner: ModelRunner, prompts: list[tuple[int, ...]], tables: list[tuple[int, ...]], tag: str
) -> list[list[int]]:
    """Greedy tokens of every sequence: one flat prefill step of all prompts, then decode steps
    of all 1,024 rows (the decode graphs' largest bucket)."""
    rids = [f"{tag}{i}" for i in range(len(prompts))]
    prefill = tuple(
        ScheduledChunk(rid, prompt, 0, table, True, GREEDY, 0)
        for rid, prompt, table in zip(rids, prompts, tables, strict=True)
    )
    sampled = runner.execute_chunks(prefill).sampled_token_ids
    tokens = [[sampled[rid]] for rid in rids]
    for step in range(DECODE_STEPS):
        rows = tuple(
            ScheduledChunk(rid, (seq[-1],), PROMPT + step, table, True, GREEDY, step + 1)
            for rid, seq, table in zip(rids, tokens, tables, strict=True)
        )
        sampled = runner.execute_chunks(rows).sampled_token_ids
        for rid, seq in zip(rids, tokens, strict=True):
            seq.append(sampled[rid])
    return tokens


def test_a_pool_past_2_31_elements_serves_1024_sequences(cuda_device: str) -> None:
    model = build_random_model(CONFIG, seed=59).to(cuda_device, torch.bfloat16)
    runner = ModelRunner(
        model, num_blocks=POOL_BLOCKS, block_size=BLOCK, device=torch.device(cuda_device),
        dtype=torch.bfloat16, cuda_graph_max_batch=SEQS, cuda_graph_max_tokens=SEQS * PROMPT,
    )  # fmt: skip
    try:
        assert runner.kv_cache.key_cache(0).numel() > 2**33
        generator = torch.Generator().manual_seed(59)
        prompts = [
            tuple(torch.randint(0, CONFIG.vocab_size, (PROMPT,), generator=generator).tolist())
            for _ in range(SEQS)
        ]
        per_seq = -(-(PROMPT + DECODE_STEPS) // BLOCK)
        count = SEQS * per_seq
        low = [tuple(range(i * per_seq, (i + 1) * per_seq)) for i in range(SEQS)]
        # The same sequences on blocks spread over the whole pool, the last one included: every
        # class of int32 wrap (negative, another block, unwrapped) holds some of them.
        spread = [i * (POOL_BLOCKS - 1) // (count - 1) for i in range(count)]
        assert any(FIRST_WRAPPED <= b < INSIDE_AGAIN for b in spread)
        assert any(b >= INSIDE_AGAIN for b in spread)
        high = [tuple(spread[i * per_seq : (i + 1) * per_seq]) for i in range(SEQS)]
        expected = _generate(runner, prompts, low, "low-")
        got = _generate(runner, prompts, high, "high-")
        wrong = [i for i in range(SEQS) if got[i] != expected[i]]
        assert not wrong, (
            f"{len(wrong)} of {SEQS} sequences differ, first on blocks {high[wrong[0]]}"
        )
    finally:
        runner.close()
