"""The GPU benchmark harness: its metrics math, its trace, and one smoke run on CPU."""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path

import pytest

from bench.engine import gpu
from bench.engine.metrics import (
    RequestTiming,
    describe_workload,
    distribution_ms,
    kv_bytes_per_token,
    percentile,
    roofline_ms,
    static_batches,
    summarize_run,
    useful_tokens,
)
from fedsim.engine_trace import WorkloadSpec, poisson_arrivals, sample_workload
from predictor.datasets import PromptRecord

# --- metrics -------------------------------------------------------------------------------


def test_percentile_interpolates_linearly_between_ranks() -> None:
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([5.0], 99) == 5.0
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 100.0
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile(values, 50) == pytest.approx(50.5)
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)
    with pytest.raises(ValueError, match="q must be"):
        percentile([1.0], 101)


def test_ttft_and_tpot_of_hand_made_timings() -> None:
    timing = RequestTiming("a", arrival_s=1.0, expected_tokens=5, prompt_tokens=7)
    timing.record_tokens(1.5, 1)
    for stamp in (2.0, 2.5, 3.0, 3.5):
        timing.record_tokens(stamp, 1)
    timing.finish_s = 3.5
    assert timing.output_tokens == 5
    assert timing.ttft_s == pytest.approx(0.5)
    # (finish - first token) / (n - 1) = 2.0 / 4
    assert timing.tpot_s == pytest.approx(0.5)
    assert timing.latency_s == pytest.approx(2.5)
    single = RequestTiming("b", arrival_s=0.0, expected_tokens=1, prompt_tokens=3)
    single.record_tokens(0.2, 1)
    single.finish_s = 0.2
    assert single.tpot_s is None  # one token has no inter-token time
    assert single.ttft_s == pytest.approx(0.2)


def test_run_summary_counts_finished_and_unfinished_requests() -> None:
    done = RequestTiming("a", arrival_s=0.0, expected_tokens=3, prompt_tokens=10)
    for stamp in (0.1, 0.2, 0.3):
        done.record_tokens(stamp, 1)
    done.finish_s = 0.3
    short = RequestTiming("b", arrival_s=0.0, expected_tokens=3, prompt_tokens=5)
    short.record_tokens(0.4, 1)
    short.finish_s = 0.4  # finished with 1 of 3 tokens: a length mismatch
    running = RequestTiming("c", arrival_s=0.5, expected_tokens=9, prompt_tokens=1)
    running.record_tokens(0.7, 2)
    summary = summarize_run(
        "x",
        [done, short, running],
        arrival="burst",
        poisson_rate=None,
        wall_s=2.0,
        steps=4,
        rejected=0,
        truncated=True,
        preemptions=1,
        kv_block_bytes=100,
        kv_blocks_total=50,
        peak_kv_blocks=7,
        max_memory_allocated_bytes=None,
        mean_running=2.0,
    )
    assert summary.completed == 2
    assert summary.output_tokens == 6
    assert summary.output_tok_s == pytest.approx(3.0)
    assert summary.requests_per_s == pytest.approx(1.0)
    assert summary.length_mismatches == 1
    assert summary.prompt_tokens == 16
    assert summary.peak_kv_bytes == 700
    assert summary.ttft is not None
    assert summary.ttft.count == 3  # the running one has a TTFT too
    assert summary.ttft.p50_ms == pytest.approx(200.0)
    assert summary.tpot is not None
    assert summary.tpot.count == 1
    assert summary.tpot.p50_ms == pytest.approx(100.0)
    assert distribution_ms([]) is None


def test_static_batching_counts_only_each_requests_own_tokens() -> None:
    assert [list(r) for r in static_batches(5, 2)] == [[0, 1], [2, 3], [4]]
    # A batch that ran 10 steps for requests of 3, 10 and 20 tokens produced 3 + 10 + 10.
    assert useful_tokens([3, 10, 20], 10) == 23
    with pytest.raises(ValueError, match="batch_size"):
        static_batches(3, 0)


def test_roofline_arithmetic() -> None:
    # Llama-3.2-1B: 16 layers, 8 KV heads of 64, bf16: 32 KiB of K and V per token.
    assert kv_bytes_per_token(16, 8, 64, 2) == 32 * 1024
    assert roofline_ms(4.8e9, 4.8e12) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="bandwidth"):
        roofline_ms(1.0, 0.0)


# --- workload ------------------------------------------------------------------------------


def _records(corpus: str, count: int, response_words: int) -> list[PromptRecord]:
    return [
        PromptRecord(corpus, i, f"prompt {i} " + "w " * (i % 7), "r " * (response_words + i))
        for i in range(count)
    ]


def _encode(text: str) -> list[int]:
    return [len(word) for word in text.split()]


def test_workload_is_deterministic_and_mixes_corpora() -> None:
    records = {"alpaca_random": _records("alpaca_random", 50, 3), "lima": _records("lima", 20, 40)}
    spec = WorkloadSpec(counts=(("alpaca_random", 8), ("lima", 4)), max_output_tokens=30, seed=5)
    first = sample_workload(records, spec, _encode)
    assert first == sample_workload(records, spec, _encode)
    other = sample_workload(records, WorkloadSpec(spec.counts, seed=6), _encode)
    assert [r.request_id for r in other] != [r.request_id for r in first]
    assert sum(r.corpus == "lima" for r in first) == 4
    assert len({r.request_id for r in first}) == 12  # drawn without replacement
    for request in first:
        assert 1 <= request.output_tokens <= 30
        assert request.output_tokens == min(request.reference_output_tokens, 30)
    assert any(r.reference_output_tokens > 30 for r in first)  # LIMA answers hit the cap
    described = describe_workload(first, spec)
    assert described["by_corpus"] == {"alpaca_random": 8, "lima": 4}
    assert described["output_tokens"] == sum(r.output_tokens for r in first)


def test_workload_caps_prompts_and_refuses_too_few_records() -> None:
    records = {"lima": [PromptRecord("lima", 0, "a " * 50, "b"), PromptRecord("lima", 1, "", "b")]}
    spec = WorkloadSpec(counts=(("lima", 1),), max_prompt_tokens=10)
    (request,) = sample_workload(records, spec, _encode)
    assert len(request.prompt_token_ids) == 10
    assert request.prompt_truncated
    with pytest.raises(ValueError, match="usable records"):
        # The empty prompt is skipped, so only one record is usable.
        sample_workload(records, WorkloadSpec(counts=(("lima", 2),)), _encode)


def test_poisson_arrivals_have_the_requested_rate() -> None:
    arrivals = poisson_arrivals(20_000, 20.0, seed=1)
    assert arrivals == poisson_arrivals(20_000, 20.0, seed=1)
    assert arrivals != poisson_arrivals(20_000, 20.0, seed=2)
    assert all(b > a for a, b in itertools.pairwise(arrivals))
    gaps = [b - a for a, b in zip([0.0, *arrivals], arrivals, strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(1 / 20.0, rel=0.03)
    # Exponential gaps: the standard deviation equals the mean.
    assert statistics.pstdev(gaps) == pytest.approx(1 / 20.0, rel=0.05)
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(3, 0.0, seed=0)


# --- end to end ----------------------------------------------------------------------------


@pytest.mark.slow
def test_small_run_on_cpu_writes_every_result(
    tmp_path: Path, gpt2_tokenizer_dir: Path, data_dir: Path
) -> None:
    results_dir = tmp_path / "results"
    payload = gpu.main(
        [
            "--small",
            "--device", "cpu",
            "--dtype", "float32",
            "--requests-alpaca", "2",
            "--requests-lima", "1",
            "--hf-requests", "2",
            "--max-num-seqs", "2",
            "--max-prompt-tokens", "24",
            "--max-response-tokens", "4",
            "--decode-batch-sizes", "1", "2",
            "--decode-steps", "2",
            "--decode-warmup-steps", "1",
            "--decode-prompt-len", "8",
            "--copy-mib", "4",
            "--engine-warmup-requests", "1",
            "--poisson-rate", "100",
            "--time-budget-s", "60",
            "--tokenizer-dir", str(gpt2_tokenizer_dir),
            "--data-dir", str(data_dir),
            "--results-dir", str(results_dir),
            "--name", "smoke",
        ]
    )  # fmt: skip
    written = json.loads((results_dir / "smoke.json").read_text())
    assert (results_dir / "smoke.md").read_text().count("|") > 10
    assert written["complete"] is True
    assert written["errors"] == {}
    assert written["command"].startswith("python -m bench.engine.gpu --small")
    for key in ("engine_tok_s", "hf_generate_tok_s", "poisson_tok_s", "engine_subset_tok_s"):
        assert written[key] > 0, key
    assert "hf_generate_batch_tok_s" in written  # None if transformers refused on CPU
    assert set(written["decode_step_ms"]) == set(written["roofline_step_ms"]) == {"1", "2"}
    assert all(v > 0 for v in written["roofline_step_ms"].values())
    assert "copy" in written["roofline_method"]
    trace_tokens = written["trace"]["output_tokens"]
    for name in ("engine_burst", "engine_poisson"):
        summary = written["runs"][name]["summary"]
        assert summary["completed"] == summary["requests"] == 3
        assert summary["output_tokens"] == trace_tokens
        assert summary["length_mismatches"] == 0
        assert summary["peak_kv_bytes"] > 0
        assert summary["ttft"]["p99_ms"] >= summary["ttft"]["p50_ms"] > 0
    assert written["ttft_ms"]["poisson"]["p50"] > 0
    generate = written["hf"]["generate"]
    assert generate["status"] == "ok"
    assert generate["requests"] == written["hf_subset_requests"] == 2
    assert generate["useful_tokens"] == written["hf_subset"]["output_tokens"]
    assert generate["generated_tokens"] >= generate["useful_tokens"]
    batch = written["hf"]["generate_batch"]
    assert batch["status"] in {"ok", "error", "truncated"}
    if batch["status"] == "error":
        assert batch["error"]
    else:
        assert batch["useful_tokens"] == written["hf_subset"]["output_tokens"]
    assert payload["engine_tok_s"] == written["engine_tok_s"]
