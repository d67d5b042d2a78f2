"""The CPU engine benchmark's measurements, on a tiny trace: it runs, and what it measures holds
the properties iteration-level scheduling guarantees."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from bench.engine.cpu import compare_batching, compare_policies, report
from bench.engine.trace import load_trace
from site_engine.make_model import make_model_dir
from site_engine.model_loading import load_model

pytestmark = pytest.mark.slow


def test_iteration_mode_never_needs_more_iterations_or_kv_than_static(
    tmp_path: Path, gpt2_tokenizer_dir: Path, data_dir: Path
) -> None:
    trace = load_trace(
        "alpaca_random", 10, gpt2_tokenizer_dir, max_total_tokens=1024, seed=3, data_dir=data_dir
    )
    # Short answers only, to keep the test quick.
    trace = [replace(r, output_tokens=min(r.output_tokens, 24)) for r in trace]
    loaded = load_model(make_model_dir(tmp_path / "m", "llama", gpt2_tokenizer_dir))
    batching = compare_batching(loaded, trace, [2, 4])
    runs = batching["runs"]
    for iteration, static in zip(runs[::2], runs[1::2], strict=True):
        assert iteration["policy"] == "fcfs"
        assert static["policy"] == "static"
        assert (
            iteration["output_tokens"]
            == static["output_tokens"]
            == sum(r.output_tokens for r in trace)
        )
        assert iteration["iterations"] <= static["iterations"]
        assert iteration["cumulative_kv_tokens"] <= static["cumulative_kv_tokens"]
    assert 0 <= batching["kv_cumulative_reduction"] < 1
    policies = compare_policies(loaded, trace, 2, seed=0)
    assert policies["mean_completion_vs_fcfs"]["fcfs"] == 1.0
    # Shortest-first with exact predictions must not lose to arrival order on mean completion
    # (a reversed or ignored ordering would).
    assert policies["mean_completion_vs_fcfs"]["spf_oracle"] <= 1.0
    assert "Iteration-level vs static" in report(batching, policies)
