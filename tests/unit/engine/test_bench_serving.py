"""The serving benchmark's pieces: goodput, SLO checks, the prompt mixes, the step shapes, and
one small run on the CPU (with this tree's own engine package standing in for a baseline)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest

from bench.engine import serving
from bench.engine.metrics import RequestTiming, percentile, summarize_run
from bench.engine.open_loop import Slo, goodput, misses
from bench.engine.serving_workload import PromptPools, build_mix, synthetic_length
from bench.engine.step_shapes import SHAPES, PrefillChunk, StepShape, build_steps, step_limits

# --- goodput --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("held", "expected"),
    [
        ({16: True, 32: True, 48: False, 40: True}, 40),
        ({16: True, 32: False, 48: True}, 16),  # a higher rate that holds after a miss: no
        ({16: False, 32: True}, None),
        ({8: True}, 8),
        ({}, None),
    ],
)
def test_goodput_is_the_highest_rate_below_the_first_miss(
    held: dict[int, bool], expected: int | None
) -> None:
    rows = [{"rate_rps": float(rate), "meets_slo": ok} for rate, ok in held.items()]
    random.Random(0).shuffle(rows)
    best = goodput(rows)
    assert (best["rate_rps"] if best else None) == expected


def _summary(ttft_s: list[float], tpot_s: float, finished: int) -> Any:
    timings = []
    for i, ttft in enumerate(ttft_s):
        timing = RequestTiming(f"r{i}", arrival_s=0.0, expected_tokens=11, prompt_tokens=3)
        timing.record_tokens(ttft, 1)
        timing.record_tokens(ttft + 10 * tpot_s, 10)
        if i < finished:
            timing.finish_s = ttft + 10 * tpot_s
        timings.append(timing)
    return summarize_run(
        "x", timings, arrival="poisson", poisson_rate=1.0, wall_s=10.0, steps=10, rejected=0,
        truncated=finished < len(ttft_s), preemptions=0, kv_block_bytes=1, kv_blocks_total=1,
        peak_kv_blocks=1, max_memory_allocated_bytes=None, mean_running=1.0,
    )  # fmt: skip


def test_slo_misses_name_each_violation() -> None:
    slo = Slo(ttft_p99_ms=1000.0, tpot_p99_ms=50.0)
    assert misses(_summary([0.1] * 20, 0.02, 20), slo) == []
    assert misses(_summary([0.1] * 19 + [3.0], 0.02, 20), slo) == ["TTFT p99 over the limit"]
    assert misses(_summary([0.1] * 20, 0.08, 20), slo) == ["TPOT p99 over the limit"]
    assert misses(_summary([0.1] * 20, 0.02, 18), slo) == ["2 request(s) unfinished"]


def test_refinement_is_halfway_between_held_and_missed() -> None:
    rows = [
        {"rate_rps": r, "meets_slo": ok} for r, ok in ((16.0, True), (32.0, True), (48.0, False))
    ]
    assert serving._refinement(rows) == 40.0
    assert serving._refinement(rows[:2]) is None
    assert serving._refinement([{"rate_rps": 16.0, "meets_slo": False}]) is None


# --- prompt mixes ---------------------------------------------------------------------------


def _pools() -> PromptPools:
    rng = random.Random(1)
    return PromptPools(
        alpaca=tuple(tuple(range(rng.randint(5, 40))) for _ in range(50)),
        gsm8k=tuple(tuple(range(rng.randint(30, 90))) for _ in range(50)),
        dolly_context=tuple(tuple(range(rng.randint(60, 900))) for _ in range(20)),
        answers=tuple(rng.randint(20, 1024) for _ in range(100)),
        vocab=1000,
        max_prompt_tokens=3072,
        max_answer_tokens=1024,
    )


def test_both_mixes_replay_the_same_answers_with_their_own_prompts() -> None:
    pools = _pools()
    short, long = build_mix(pools, "short", 400, seed=7), build_mix(pools, "long", 400, seed=7)
    assert [r.output_tokens for r in short] == [r.output_tokens for r in long]
    assert {r.corpus for r in short} == {"alpaca_random", "gsm8k"}
    assert {r.corpus for r in long} == {"dolly_context", "synthetic_lognormal"}
    assert len({r.request_id for r in short + long}) == 800
    mean = sum(len(r.prompt_token_ids) for r in long) / len(long)
    assert mean > 3 * sum(len(r.prompt_token_ids) for r in short) / len(short)
    assert build_mix(pools, "long", 400, seed=7) == long  # deterministic
    assert build_mix(pools, "long", 400, seed=8) != long


def test_synthetic_lengths_are_lognormal_with_median_250_and_p99_3000() -> None:
    rng = random.Random(3)
    lengths = [float(synthetic_length(rng, cap=100_000)) for _ in range(40_000)]
    assert percentile(lengths, 50) == pytest.approx(250, rel=0.05)
    assert percentile(lengths, 99) == pytest.approx(3000, rel=0.12)
    capped = [synthetic_length(rng, cap=3072) for _ in range(2000)]
    assert max(capped) <= 3072
    assert min(capped) >= 1
    assert math.isclose(sum(c == 3072 for c in capped) / 2000, 0.01, abs_tol=0.01)


# --- step shapes ----------------------------------------------------------------------------


def test_the_parts_of_a_mixed_step_are_its_own_chunks() -> None:
    shape = StepShape("s", "d", 3, 40, (PrefillChunk(20, 12), PrefillChunk(0, 9)))
    steps = build_steps(shape, block_size=16, num_blocks=64, vocab=100, seed=0)
    mixed = steps["mixed"].chunks
    assert steps["decode_only"].chunks + steps["prefill_only"].chunks == mixed
    assert steps["mixed"].num_batched_tokens == shape.tokens == 3 + 21
    tables = [c.block_table for c in mixed]
    assert len({b for t in tables for b in t}) == sum(len(t) for t in tables)  # no block shared
    continuing, fresh = steps["prefill_only"].chunks
    assert (continuing.start_position, continuing.num_tokens, len(continuing.block_table)) == (
        20, 12, 2,
    )  # fmt: skip
    assert (fresh.start_position, fresh.num_tokens) == (0, 9)
    assert all(c.start_position == 39 and c.num_tokens == 1 for c in steps["decode_only"].chunks)
    with pytest.raises(ValueError, match="more than"):
        build_steps(shape, block_size=16, num_blocks=8, vocab=100, seed=0)


def test_the_step_engine_admits_every_shape_whole() -> None:
    max_seqs, max_tokens = step_limits(SHAPES)
    for shape in SHAPES:
        steps = build_steps(shape, block_size=16, num_blocks=100_000, vocab=100, seed=0)
        assert len(steps["mixed"].chunks) <= max_seqs, shape.name
        assert steps["mixed"].num_batched_tokens <= max_tokens, shape.name
    assert max_seqs == 232  # short_prompts: 192 decode rows + 40 prompts


# --- end to end -----------------------------------------------------------------------------


@pytest.mark.slow
def test_small_run_on_cpu_writes_every_result(
    tmp_path: Path, gpt2_tokenizer_dir: Path, data_dir: Path
) -> None:
    engine_package = Path(serving.__file__).resolve().parents[2] / "site_engine" / "engine"
    payload = serving.main(
        [
            "--small", "--device", "cpu", "--dtype", "float32",
            "--phases", "steps,decode,sweep,burst",
            "--rates", "2", "4", "--duration-s", "1",
            "--baseline-engine", str(engine_package),
            "--model-dir", str(tmp_path / "model"),
            "--tokenizer-dir", str(gpt2_tokenizer_dir), "--data-dir", str(data_dir),
            "--results-dir", str(tmp_path / "results"), "--name", "smoke",
        ]
    )  # fmt: skip
    written = json.loads((tmp_path / "results" / "smoke.json").read_text())
    assert written["complete"]
    assert written["errors"] == {}
    assert (tmp_path / "results" / "smoke.png").stat().st_size > 10_000
    assert (tmp_path / "results" / "smoke.md").read_text().count("|") > 40
    assert set(written["mixed_vs_parts"]) == {"tiny"}
    assert written["mixed_vs_parts"]["tiny"] > 0
    assert written["step_shapes"][0]["mixed_path"] == "eager forward + decode graphs"  # CPU
    for mix in ("short", "long"):
        rows = written["sweeps"][mix]
        assert [r["rate_rps"] for r in rows][:1] == [2.0]
        assert all(r["completed"] == r["requests"] for r in rows)
        assert all(r["queue_depth_max"] is not None for r in rows)
        assert mix in written["goodput_rate_rps"]
    burst = written["burst"]["summary"]
    assert burst["completed"] == burst["requests"] == 8
    baseline = written["baseline"]
    assert baseline["returncode"] == 0, baseline
    assert baseline["burst"]["summary"]["output_tokens"] == burst["output_tokens"]
    assert set(baseline["mixed_vs_parts"]) == {"tiny"}
    assert payload["goodput_rate_rps"] == written["goodput_rate_rps"]
