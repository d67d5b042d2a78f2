"""The input variants of bench.engine.prefill_in_engine, on CPU tensors: each differs from the
engine's launch in the one respect it names and keeps the attention's inputs the same."""

from __future__ import annotations

import torch

from bench.engine import prefill_in_engine as bench

TOKENS, HEADS, KV_HEADS, DIM, BLOCK = 100, 8, 2, 16, 16


def _engine_inputs() -> bench.Inputs:
    generator = torch.Generator().manual_seed(0)
    fused = torch.randn(TOKENS, (HEADS + 2 * KV_HEADS) * DIM, generator=generator)
    query = fused[:, : HEADS * DIM].view(TOKENS, HEADS, DIM)  # a view of the fused QKV rows
    cache = torch.randn(2, 50, BLOCK, KV_HEADS, DIM, generator=generator)
    table = torch.zeros(1, 20, dtype=torch.int32)
    table[0, :12] = torch.tensor([5, 9, 7, 8, 30, 10, 11, 12, 40, 14, 15, 16])
    return {
        "query": bench._strided_copy(query, TOKENS), "key_cache": cache[0],
        "value_cache": cache[1], "block_tables": table,
        "query_start_loc": torch.tensor([0, TOKENS], dtype=torch.int32),
        "context_lens": torch.tensor([180], dtype=torch.int32),
        "options": {"scale": 0.25, "skip_single": True}, "num_tokens": TOKENS,
    }  # fmt: skip


def test_the_kept_query_has_the_engines_strides_and_values() -> None:
    x = _engine_inputs()
    assert x["query"].stride() == ((HEADS + 2 * KV_HEADS) * DIM, DIM, 1)
    assert not x["query"].is_contiguous()


def test_padding_adds_empty_sequences_and_zero_rows_only() -> None:
    x = _engine_inputs()
    padded = bench._padded(x, seqs=8, bucket=128)
    assert padded["query"].shape[0] == 128
    assert padded["num_tokens"] == 128
    assert padded["query"].stride() == x["query"].stride()
    assert torch.equal(padded["query"][:TOKENS], x["query"])
    assert not padded["query"][TOKENS:].any()
    assert padded["query_start_loc"].tolist() == [0] + [TOKENS] * 8
    assert padded["context_lens"].shape[0] == 8
    assert padded["block_tables"].shape[0] == 8


def test_a_compact_or_shuffled_cache_holds_the_same_keys_and_values() -> None:
    x = _engine_inputs()
    used = 12  # 180 positions in blocks of 16
    original = x["block_tables"][0, :used].long()
    for shuffle in (False, True):
        compact = bench._compact(x, shuffle=shuffle, random_values=False)
        table = compact["block_tables"][0, :used].long()
        assert torch.equal(compact["key_cache"][table], x["key_cache"][original])
        assert torch.equal(compact["value_cache"][table], x["value_cache"][original])
        assert compact["key_cache"].stride() == compact["value_cache"].stride()
        assert torch.equal(compact["query"], x["query"])
