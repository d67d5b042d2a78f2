"""The long-prefill benchmark's arithmetic, the long-context serving mix, and one small CPU run
of bench.engine.prefill_long (the GPU run writes
bench/results/engine_prefill/engine_prefill_long_h100.*)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.engine import prefill_long
from bench.engine.model_setup import LLAMA_1B_LONG_SHAPE
from bench.engine.prefill_kernels import HeadLayout, attention_flops, chunk_plan
from bench.engine.serving_traces import build_trace_mix, fit_to_context, load_trace_lengths


def test_chunk_plan_covers_the_prompt_with_cached_prefixes() -> None:
    assert chunk_plan(20000, 8192) == [(0, 8192), (8192, 8192), (16384, 3616)]
    assert chunk_plan(100, 8192) == [(0, 100)]


def test_attention_flops_count_each_visible_pair_once() -> None:
    layout = HeadLayout(heads=2, kv_heads=1, head_dim=4)
    # One chunk of 3 from scratch: 1 + 2 + 3 pairs; a chunk of 2 after 3 cached: 2*3 + 1 + 2.
    assert attention_flops([(0, 3)], layout) == 4 * 4 * 2 * 6
    assert attention_flops([(0, 3), (3, 2)], layout) == 4 * 4 * 2 * (6 + 9)
    # Chunking does not change the work: the same pairs in any split.
    whole = attention_flops(chunk_plan(32000, 32000), layout)
    assert attention_flops(chunk_plan(32000, 8192), layout) == whole


def test_prefill_flops_of_the_1b_shape() -> None:
    tokens = 32000
    flops = prefill_long.prefill_flops(LLAMA_1B_LONG_SHAPE, tokens)
    # ~0.97e9 parameters in the decoder's matrix products: 2 * 0.97e9 * 32000 = 62 TFLOP, and
    # causal attention 4 * 64 * 32 * 16 * 32000^2 / 2 = 67 TFLOP.
    assert 128e12 < flops < 130e12
    assert prefill_long.prefill_flops(LLAMA_1B_LONG_SHAPE, 2 * tokens) > 2 * flops


def test_trace_mix_fits_the_context(data_dir: Path) -> None:
    lengths = load_trace_lengths(data_dir / "traces")
    assert len(lengths.azure) == 19366
    assert len(lengths.mooncake) == 3993
    requests = build_trace_mix(lengths, 200, seed=1, vocab=1000, context=32768)
    assert [r.corpus for r in requests[:2]] == ["azure_conv", "mooncake_synthetic"]
    for request in requests:
        assert len(request.prompt_token_ids) + request.output_tokens <= 32768
        assert request.output_tokens >= 1
    mooncake = [len(r.prompt_token_ids) for r in requests if r.corpus == "mooncake_synthetic"]
    assert max(mooncake) > 16000  # long prompts, as the trace has them
    assert build_trace_mix(lengths, 10, 1, vocab=1000, context=32768) == requests[:10]
    assert fit_to_context(200000, 100, 131072) == (130972, 100, True)
    assert fit_to_context(500, 0, 4096) == (500, 1, False)


@pytest.mark.slow
def test_small_run_writes_results(tmp_path: Path, gpt2_tokenizer_dir: Path) -> None:
    payload = prefill_long.main([
        "--small", "--device", "cpu", "--dtype", "float32", "--reps", "1", "--phases", "hf,engine",
        "--results-dir", str(tmp_path), "--model-dir", str(tmp_path / "model"),
        "--tokenizer-dir", str(gpt2_tokenizer_dir), "--name", "smoke", "--engine-chunks", "96",
    ])  # fmt: skip
    assert payload["complete"]
    assert set(payload["engine_over_hf"]) == {"64", "200"}
    written = json.loads((tmp_path / "smoke.json").read_text())
    assert written["table"]["200"]["engine_ms"] > 0
    # The rerun with 96 tokens a step prefills the 200-token prompt in 3 steps instead of 5.
    assert written["engine_chunk[96]"]["200"]["engine_ms"] > 0
    text = (tmp_path / "smoke.md").read_text()
    assert "engine / HF" in text
    assert "| engine_chunk[96] |" in text
