"""The numbers a GPU engine chooses: batch limits from the device, the KV cache from a trial's
measurements, the refusals that name them, and the start-up report (pure arithmetic, no GPU)."""

from __future__ import annotations

import pytest

from site_engine.engine.memory_plan import (
    GIB,
    MAX_BLOCKS,
    RESERVE_SHARE,
    KvCacheTooSmall,
    KvCacheUnindexable,
    TrialMeasurement,
    batch_defaults,
    plan_from_budget,
    plan_kv_cache,
    startup_report,
)
from site_engine.engine.memory_trial import graph_count

H100 = 80 * GIB  # what torch reports as an H100's total is ~79.2 GiB: still >= 70


@pytest.mark.parametrize(
    ("device", "total", "name", "expected"),
    [
        ("cuda", int(79.2 * GIB), "NVIDIA H100 80GB HBM3", (1024, 8192)),
        ("cuda", int(139.8 * GIB), "NVIDIA H200", (1024, 8192)),
        ("cuda", int(79.2 * GIB), "NVIDIA A100-SXM4-80GB", (256, 2048)),
        ("cuda", int(44.4 * GIB), "NVIDIA L40S", (256, 2048)),
        ("cpu", 0, "", (16, 2048)),
    ],
)
def test_batch_defaults_follow_vllm(
    device: str, total: int, name: str, expected: tuple[int, int]
) -> None:
    chosen = batch_defaults(device, total, name)
    assert (chosen.max_num_seqs, chosen.max_num_batched_tokens) == expected
    assert chosen.reason


def _trial(free_gib: float, needs_gib: float = 6.0) -> TrialMeasurement:
    return TrialMeasurement(
        total=H100, free=int(free_gib * GIB), weights=int(2.3 * GIB),
        step_and_sampler=int(needs_gib * GIB), graph_driver=48 << 22, graphs=48,
    )  # fmt: skip


def test_the_cache_takes_what_is_free_after_needs_and_reserve() -> None:
    trial = _trial(free_gib=75.0)
    per_block = 16 * 32 * 1024  # a 1B model's 32 KiB per token
    plan = plan_kv_cache(trial, bytes_per_block=per_block, block_size=16, max_model_len=131072)
    left = trial.free - trial.step_and_sampler - trial.graph_driver - int(H100 * RESERVE_SHARE)
    assert plan.num_blocks == left // per_block
    assert plan.kv_bytes <= left < plan.kv_bytes + per_block
    assert plan.tokens == plan.num_blocks * 16
    assert plan.full_length_sequences == plan.num_blocks // (131072 // 16)


def test_a_cache_too_small_for_one_sequence_is_refused_with_its_numbers() -> None:
    per_block = 16 * 128 * 1024  # an 8B model's 128 KiB per token
    with pytest.raises(KvCacheTooSmall) as refused:
        plan_kv_cache(_trial(free_gib=20.0, needs_gib=6.0), bytes_per_block=per_block,
                      block_size=16, max_model_len=131072)  # fmt: skip
    message = str(refused.value)
    assert "131,072 tokens" in message and "needs 16.00 GiB" in message  # noqa: PT018
    assert "the device has 80.00 GiB, 20.00 GiB free" in message
    assert "largest step, the sampler and the CUDA graph pool take 6.00 GiB" in message
    assert "model of at most" in message


def test_an_explicit_cache_that_does_not_fit_is_refused() -> None:
    trial = _trial(free_gib=30.0)
    with pytest.raises(KvCacheTooSmall, match=r"a KV cache of 40.00 GiB does not fit"):
        plan_kv_cache(trial, bytes_per_block=1 << 19, block_size=16, max_model_len=4096,
                      requested_bytes=40 * GIB)  # fmt: skip
    plan = plan_kv_cache(trial, bytes_per_block=1 << 19, block_size=16, max_model_len=4096,
                         requested_bytes=10 * GIB)  # fmt: skip
    assert plan.num_blocks == 10 * GIB // (1 << 19)


def test_a_budget_without_a_trial() -> None:
    assert plan_from_budget(1 << 20, bytes_per_block=1 << 16, block_size=16,
                            max_model_len=64).num_blocks == 16  # fmt: skip
    with pytest.raises(KvCacheTooSmall, match="holds no block"):
        plan_from_budget(100, bytes_per_block=1 << 16, block_size=16, max_model_len=64)


def test_startup_report_names_blocks_tokens_gib_fit_and_graphs() -> None:
    plan = plan_kv_cache(_trial(free_gib=75.0), bytes_per_block=1 << 19, block_size=16,
                         max_model_len=131072)  # fmt: skip
    line = startup_report(plan, "48 CUDA graphs captured, 1.20 GiB")
    assert "\n" not in line
    assert f"{plan.num_blocks:,} blocks of 16 tokens = {plan.tokens:,} tokens" in line
    assert f"{plan.kv_bytes / GIB:.2f} GiB" in line
    assert f"{plan.full_length_sequences:,} sequence(s) of max_model_len 131,072" in line
    assert "48 CUDA graphs captured, 1.20 GiB" in line
    assert "weights 2.30 GiB" in line


def test_graph_count_matches_the_buckets() -> None:
    # decode graphs, flat-step bodies, and lm_head graphs for up to min(1024, 8192) rows
    assert graph_count(1024, 8192, cuda_graphs=True) == 25 + 23 + 25
    assert graph_count(256, 96, cuda_graphs=True) == 17 + 4 + 11
    assert graph_count(256, 2048, cuda_graphs=False) == 0
    assert graph_count(4, 1, cuda_graphs=True) == 3  # no flat step graphs under 2 tokens


def test_an_explicit_cache_smaller_than_one_sequence_is_the_operators_choice() -> None:
    """Tests force preemption with a tiny cache; only the automatic size must hold a full one."""
    plan = plan_kv_cache(_trial(free_gib=30.0), bytes_per_block=1 << 19, block_size=16,
                         max_model_len=131072, requested_bytes=64 << 20)  # fmt: skip
    assert plan.num_blocks == 128
    assert plan.full_length_sequences == 0


def test_more_blocks_than_the_kernels_index_are_capped_or_refused_with_the_numbers() -> None:
    """Block ids are int32 in the kernels' block tables: a cache of tiny blocks on a large device
    (here 32-byte blocks: one layer, one KV head of 8 at block size 1, in 80 GiB) holds more
    than 2^31 - 1 of them. The automatic size is capped there and says so; an explicit one, and
    a budget without a trial, are refused naming the limit and the numbers."""
    trial = _trial(free_gib=75.0)
    plan = plan_kv_cache(trial, bytes_per_block=32, block_size=1, max_model_len=4096)
    free_blocks = (trial.free - trial.step_and_sampler - trial.graph_driver
                   - int(H100 * RESERVE_SHARE)) // 32  # fmt: skip
    assert free_blocks > MAX_BLOCKS == 2**31 - 1
    assert plan.num_blocks == MAX_BLOCKS
    assert plan.uncapped_blocks == free_blocks
    assert f"capped from {free_blocks:,} blocks at the 2,147,483,647" in startup_report(plan, "")
    with pytest.raises(KvCacheUnindexable) as refused:
        plan_kv_cache(trial, bytes_per_block=32, block_size=1, max_model_len=4096,
                      requested_bytes=68 * GIB)  # fmt: skip
    message = str(refused.value)
    assert "a KV cache of 68.00 GiB is 2,281,701,376 blocks of 32 bytes" in message
    assert "at most 2,147,483,647 blocks (block ids are int32" in message
    assert "give at most 64.00 GiB" in message
    with pytest.raises(KvCacheUnindexable, match=r"2,348,810,240 blocks of 32 bytes"):
        plan_from_budget(70 * GIB, bytes_per_block=32, block_size=1, max_model_len=4096)
    exact = plan_kv_cache(trial, bytes_per_block=32, block_size=1, max_model_len=4096,
                          requested_bytes=MAX_BLOCKS * 32)  # fmt: skip
    assert exact.num_blocks == MAX_BLOCKS and exact.uncapped_blocks == 0  # noqa: PT018
    assert "capped" not in startup_report(plan_kv_cache(
        trial, bytes_per_block=1 << 19, block_size=16, max_model_len=4096), "")  # fmt: skip
