"""bench.engine.finetune_share_profile's logic: a kernel timeline cut into steps at markers, each
step's work from the calls that launched and returned it, and the decision from the three
parts' figures; and the whole profile's CPU smoke (no streams, no kernels there)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from bench.engine.finetune_share_profile import Run, main
from bench.engine.finetune_share_report import decide
from bench.engine.finetune_share_serving import Call, step_work
from bench.engine.finetune_share_timeline import (
    MARKER,
    Interval,
    Roofline,
    StepWork,
    kind,
    split_steps,
    summarize,
)
from bench.engine.harness import Progress
from bench.engine.priority_driver import Shape

MS = 1_000_000


def _at(name: str, start_ms: float, end_ms: float) -> Interval:
    return Interval(name, int(start_ms * MS), int(end_ms * MS))


def test_kernels_are_told_apart_by_name() -> None:
    assert kind("nvjet_tst_128x64_64x4_1x1_h_bz_NNT") == "gemm"
    assert kind("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert kind("_paged_decode_kernel") == "attention"
    assert kind("pytorch_flash::flash_fwd_kernel<...>") == "attention"
    assert kind("_rms_norm_kernel") == "other"
    assert kind("Memcpy HtoD (Pinned -> Device)") == "copy"
    assert kind("Event Sync") == "sync"


def test_steps_are_cut_at_markers_and_a_wait_is_not_idle_time() -> None:
    intervals = [
        _at(MARKER, 0.0, 0.001),
        _at("nvjet_gemm", 0.1, 4.0),
        _at("_paged_decode_kernel", 4.0, 6.0),
        _at("Memcpy DtoH (Device -> Pinned)", 6.0, 9.0),  # a copy engine's, not the SMs'
        _at("Event Sync", 6.0, 9.5),  # a host's wait drawn on the device's row
        _at(MARKER, 10.0, 10.001),
        _at("_rms_norm_kernel", 10.1, 12.0),
        _at(MARKER, 20.0, 20.001),  # the loop waited from 12 ms on
        _at(MARKER, 21.0, 21.001),  # an empty step: no kernel
        _at(MARKER, 22.0, 22.001),
    ]
    work = [
        StepWork(prefill_tokens=260, decode_rows=40, sampled_rows=41, wait_after=False),
        StepWork(prefill_tokens=0, decode_rows=40, sampled_rows=40, wait_after=True),
        StepWork(prefill_tokens=0, decode_rows=0, sampled_rows=0, wait_after=False),
        StepWork(prefill_tokens=0, decode_rows=1, sampled_rows=1, wait_after=False),
    ]
    line = Roofline(
        peak_flops=1e12, memory_bytes_per_s=5e9, flops_per_token=1e6, flops_per_sampled_row=1e5
    )
    assert line.ridge_tokens == 200
    rows = split_steps(intervals, work, line)
    assert len(rows) == 2  # the empty step and the unclosed last one are left out
    first, second = rows
    assert first["window_ms"] == pytest.approx(10.0)
    assert first["busy_fraction"] == pytest.approx(5.9 / 10)
    assert first["copy_ms"] == pytest.approx(3.0)
    assert first["tokens"] == 300
    # 300 tokens are past the ridge: its GEMM is compute-bound, its attention is not.
    assert first["memory_bound_share"] == pytest.approx(2.0 / 10)
    assert first["compute_fraction"] == pytest.approx((300e6 + 41e5) / (1e12 * 0.010))
    assert second["window_ms"] == pytest.approx(2.0)  # ends at its last kernel
    assert second["between_steps_ms"] == pytest.approx(8.0)
    assert second["busy_fraction"] == pytest.approx(1.9 / 2.0)
    assert second["memory_bound_share"] == pytest.approx(1.9 / 2.0)
    summary = summarize(rows)
    assert summary["steps"] == 2
    assert summary["busy_fraction_time_weighted"] == pytest.approx((5.9 + 1.9) / 12)
    assert summary["share_of_step_time"]["gemm"] == pytest.approx(3.9 / 12)
    assert summary["between_steps_ms_total"] == pytest.approx(8.0)
    assert summary["steps_with_prefill"] == 0.5


def test_overlapping_kernels_count_once_toward_busy_time() -> None:
    intervals = [
        _at(MARKER, 0, 0.001),
        _at("a_gemm", 1, 5),
        _at("b_gemm", 3, 6),
        _at(MARKER, 10, 10.001),
    ]
    work = [StepWork(0, 8, 8, False)]
    (row,) = split_steps(intervals, work, None)
    assert row["busy_fraction"] == pytest.approx(5 / 10)
    assert "compute_fraction" not in row


def test_a_steps_rows_come_back_with_the_next_call_under_async_scheduling() -> None:
    calls = [
        Call(0.0, 0.01, prefill_tokens=100, sampled=5, first=0, in_flight=True),
        Call(0.01, 0.01, prefill_tokens=0, sampled=8, first=2, in_flight=True),
        Call(0.02, 0.01, prefill_tokens=0, sampled=9, first=0, in_flight=True),
    ]
    assert step_work(calls) == [StepWork(100, 6, 8, False), StepWork(0, 9, 9, False)]
    calls = [
        Call(0.0, 0.01, prefill_tokens=30, sampled=2, first=2, in_flight=False, wait_after=True)
    ]
    assert step_work(calls) == [StepWork(30, 0, 2, True)]


def _result(low: dict[str, float], rows: list[dict[str, float]]) -> dict[str, Any]:
    """A GPU run's figures as decide reads them: a 10 ms step at the load, training alone at
    10,000 tok/s."""
    return {
        "serving": {"call_ms_unprofiled": {"p50": 10.0}},
        "priority": {
            "training_mode": "cuda graph",
            "training_alone": {"tokens_per_s": 10_000.0},
            "decode_step_ms": {"alone": {}, "low": low},
        },
        "rows": {"by_decode_rows": {"256": [], "40": [{"train_tokens": 0}, *rows]}},
    }


def _low(job_tokens_per_s: float, p50_ratio: float, p99_added_ms: float) -> dict[str, float]:
    return {
        "training_tokens_per_s": job_tokens_per_s,
        "p50_vs_alone": p50_ratio,
        "p99_vs_alone": p50_ratio,
        "p99_added_ms": p99_added_ms,
        "max_added_ms": p99_added_ms,
    }


def _row(tokens: int, forward_ms: float, backward_ms: float) -> dict[str, float]:
    return {
        "train_tokens": tokens,
        "marginal_ms": forward_ms,
        "backward_ms": backward_ms,
        "training_forward_backward_ms": 1000 * tokens / 5_000,
    }


def test_spatial_sharing_is_favoured_when_it_alone_meets_the_targets() -> None:
    decision = decide(_result(_low(6_000, 1.1, 5.0), [_row(256, 1.0, 6.0)]))
    assert decision["favoured"] == "spatial sharing"
    spatial = decision["approaches"]["spatial sharing"]
    assert spatial["job_vs_alone"] == pytest.approx(0.6)
    in_step = decision["approaches"]["training rows in the step"]
    assert in_step["budget_ms"] == pytest.approx(2.0)  # 0.2 x the 10 ms step
    assert not in_step["fits_budget"]
    assert not in_step["meets"]


def test_rows_in_the_step_are_favoured_when_they_fit_and_spatial_sharing_delays_steps() -> None:
    rows = [_row(64, 0.2, 0.3), _row(256, 0.5, 1.0), _row(1024, 3.0, 4.0)]
    decision = decide(_result(_low(6_000, 1.1, 30.0), rows))
    assert decision["favoured"] == "training rows in the step"
    in_step = decision["approaches"]["training rows in the step"]
    assert in_step["train_tokens"] == 256  # the most that fits 2 ms
    assert in_step["decode_rows"] == 40
    assert in_step["job_vs_alone"] == pytest.approx(256 / 0.0115 / 10_000)


def test_with_no_approach_meeting_the_targets_the_closest_is_named_and_a_mix_suggested() -> None:
    decision = decide(_result(_low(5_000, 1.5, 12.0), [_row(256, 1.0, 6.0)]))
    assert decision["favoured"] == "spatial sharing"  # worst 1.5/1.2 TPOT against 1.7/1.2
    assert "neither meets" in decision["why"]
    assert decision["mix_suggested"]  # the rows' forward fits, their backward does not


def test_the_cpu_smoke_and_a_failed_part_decide_nothing() -> None:
    result = _result(_low(1.0, 1.0, 0.0), [])
    del result["priority"]["decode_step_ms"]["low"]  # the CPU runs no stream beside
    assert decide(result)["why"].startswith("CPU smoke")
    result = _result(_low(6_000, 1.1, 5.0), [_row(256, 1.0, 6.0)])
    result["rows"] = {"error": "RuntimeError('CUDA error: out of memory')"}
    decision = decide(result)
    assert decision["favoured"] is None
    assert decision["why"] == "no decision: rows failed or did not run"


def test_a_failed_part_is_written_with_its_error_and_the_run_goes_on(tmp_path: Path) -> None:
    p = {"shape": {}, "interactive": Shape((1, 2), (1, 2))}
    args = argparse.Namespace(name="run", p=p, load=0.6, seed=0, argv=["--cpu-smoke"],
                              results_dir=tmp_path)  # fmt: skip
    run = Run(args, "cpu", Progress())

    def fails() -> dict[str, Any]:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    assert run.part("serving", fails) is None
    written = json.loads((tmp_path / "run.json").read_text())
    assert written["serving"]["error"].startswith("RuntimeError: CUDA error")
    assert written["settings"]["interactive"] == {"prompt": [1, 2], "answer": [1, 2]}
    assert written["decision"]["why"] == (
        "no decision: serving, priority, rows failed or did not run"
    )
    markdown = (tmp_path / "run.md").read_text()
    assert "Failed: RuntimeError: CUDA error" in markdown
    assert "## 2. Beside decode steps\n\nNot measured" in markdown


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_cpu_smoke_writes_every_part(tmp_path: Path, gpt2_tokenizer_dir: Path) -> None:
    main(
        ["--cpu-smoke", "--tokenizer-dir", str(gpt2_tokenizer_dir), "--results-dir", str(tmp_path)]
    )
    result = json.loads((tmp_path / "finetune_share_profile_cpu.json").read_text())
    assert result["command"].startswith("python -m bench.engine.finetune_share_profile")
    serving = result["serving"]
    assert serving["capacity_rps"] > 0
    assert serving["calls_profiled"] > 0
    assert serving["timeline"].startswith("none on the CPU")
    priority = result["priority"]
    assert priority["streams"].startswith("not on the CPU")
    assert list(priority["decode_step_ms"]) == ["alone"]
    assert priority["decode_step_ms"]["alone"]["n"] == 8  # two blocks of four steps
    assert priority["training_alone"]["tokens_per_s"] > 0
    (entries,) = result["rows"]["by_decode_rows"].values()
    assert [e["train_tokens"] for e in entries] == [0, 8, 32, 64]
    assert all(e["training_forward_backward_ms"] > 0 for e in entries[1:])
    assert result["decision"]["favoured"] is None
    markdown = (tmp_path / "finetune_share_profile_cpu.md").read_text()
    assert "## 3. N training tokens in a decode step" in markdown
