"""The engine loop's host term: what async scheduling hides, fitted on whole engine steps."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from fedsim.calibrate.host import REPLAYED_SWEEP, engine_step_rows, fit_host
from fedsim.step_time import HostOverhead, StepFeatures, StepTimeModel

KERNEL = StepTimeModel(
    "h200", base_s=2e-3, per_prefill_token_s=0.0, per_decode_row_s=1e-5, per_kv_token_s=0.0
)


def decode(rows: int) -> StepFeatures:
    return StepFeatures(0, rows, 0, 0, 0)


def test_period_is_the_longer_of_device_and_host() -> None:
    host = HostOverhead(base_s=3e-4, per_row_s=5e-6)
    model = replace(KERNEL, host=host)
    # 100 rows: grid 3 ms = device 2.2 ms + host 0.8 ms in series; overlapped: 2.2 ms.
    assert model.seconds(decode(100)) == pytest.approx(2.2e-3)
    # A host slower than the device (loop_scale) sets the period.
    slow = replace(KERNEL, host=replace(host, loop_scale=4.0))
    assert slow.seconds(decode(100)) == pytest.approx(3.2e-3)
    # No host term: the grid's time.
    assert KERNEL.seconds(decode(100)) == pytest.approx(3e-3)


def test_fit_host_recovers_the_hidden_time() -> None:
    truth = HostOverhead(base_s=2.5e-4, per_row_s=7e-6)
    rows = [(decode(b), replace(KERNEL, host=truth).seconds(decode(b))) for b in (1, 32, 128, 256)]
    fitted = fit_host(KERNEL, rows)
    assert fitted.base_s == pytest.approx(truth.base_s, rel=1e-6)
    assert fitted.per_row_s == pytest.approx(truth.per_row_s, rel=1e-6)


def test_host_term_round_trips_through_json() -> None:
    model = replace(KERNEL, host=HostOverhead(1e-4, 2e-6, 1.5))
    assert StepTimeModel.from_json(model.to_json()) == model
    with pytest.raises(ValueError, match="unknown"):
        StepTimeModel.from_json({**model.to_json(), "bogus_s": 1.0})


def _sweep_rows(ms_by_rows: dict[int, float]) -> list[dict[str, float]]:
    return [
        {"batch_size": b, "mean_context_len": 550.0, "decode_step_ms": ms}
        for b, ms in ms_by_rows.items()
    ]


def test_the_replayed_runs_sweep_sets_the_host_rows_before_a_grids(tmp_path: Path) -> None:
    """The engine whose workloads are replayed describes its own period; a grid's engine steps
    serve the shapes that run has not measured, the older sweeps only what neither has."""
    results = tmp_path / "results"
    card, model, relative = REPLAYED_SWEEP
    (results / relative).parent.mkdir(parents=True)
    (results / relative).write_text(json.dumps({"decode_sweep": _sweep_rows({1: 1.4, 256: 3.2})}))
    grid = tmp_path / "grid.json"
    grid.write_text(
        json.dumps(
            {
                "models": [
                    {"device": card, "model": model, "engine_steps": _sweep_rows({256: 5.3})},
                    {"device": card, "model": "llama8b", "engine_steps": _sweep_rows({1: 5.0})},
                ]
            }
        )
    )
    rows = engine_step_rows(results, [grid])
    assert [seconds for _, seconds in rows[(card, model)]] == pytest.approx([1.4e-3, 3.2e-3])
    assert [f.decode_rows for f, _ in rows[(card, model)]] == [1, 256]
    assert [seconds for _, seconds in rows[(card, "llama8b")]] == pytest.approx([5e-3])
    # Without the replayed run's file, the grid's rows are the 1B's.
    (results / relative).unlink()
    assert [s for _, s in engine_step_rows(results, [grid])[(card, model)]] == pytest.approx(
        [5.3e-3]
    )


def test_a_step_that_admits_adds_host_time_per_kv_token_only_where_the_host_sets_the_pace() -> None:
    host = HostOverhead(base_s=3e-4, per_row_s=5e-6, per_kv_token_admitting_s=1e-7)
    model = replace(KERNEL, host=host)
    admitting = StepFeatures(16, 99, 20_000, 256, 0)  # 100 rows, 20k KV tokens read
    # Host: 0.8 ms + 2 ms of KV = 2.8 ms, over the device's 2.2 ms (grid 3 ms less 0.8).
    assert model.seconds(admitting) == pytest.approx(2.8e-3, rel=1e-3)
    # The same step without a prompt chunk: the device's 2.2 ms, as without the term.
    assert model.seconds(decode(100)) == pytest.approx(2.2e-3)
    # Few KV tokens: the device still sets the pace, the term changes nothing.
    light = StepFeatures(16, 99, 1_000, 256, 0)
    assert model.seconds(light) == replace(
        KERNEL, host=replace(host, per_kv_token_admitting_s=0)
    ).seconds(light)


def test_a_step_that_admits_adds_a_constant_of_host_time_where_the_host_sets_the_pace() -> None:
    host = HostOverhead(base_s=3e-4, per_row_s=5e-6, admitting_step_s=2e-3)
    model = replace(KERNEL, host=host)
    # Host: 0.8 ms + 2 ms = 2.8 ms, over the device's 2.2 ms, whatever KV the rows read.
    for kv in (1_000, 20_000):
        assert model.seconds(StepFeatures(16, 99, kv, 256, 0)) == pytest.approx(2.8e-3, rel=1e-3)
    assert model.seconds(decode(100)) == pytest.approx(2.2e-3)


def test_the_admitting_term_fitted_on_a_burst_recovers_its_wall_time() -> None:
    from fedsim.calibrate.replay import MeasuredRun, burst_steps, fit_admitting
    from fedsim.workload import SimRequest

    requests = [
        SimRequest(f"r{i}", 0.0, tuple(range(i * 1000, i * 1000 + 400)), 60 + i % 7, 80)
        for i in range(300)
    ]
    truth = replace(KERNEL, host=HostOverhead(3e-4, 5e-6, admitting_step_s=1.5e-3))
    start = replace(truth, host=replace(truth.host, admitting_step_s=0.0))
    probe = MeasuredRun("burst", "test", {"wall_s": 1.0}, requests, 64, 2048, 16)
    steps = burst_steps(probe, start)
    wall = sum(truth.seconds(f) for f in steps)
    assert wall > sum(start.seconds(f) for f in steps)  # the term binds in some steps
    measured = replace(probe, summary={"wall_s": wall})
    assert fit_admitting(measured, start) == pytest.approx(1.5e-3, rel=1e-3)
    with pytest.raises(ValueError, match="not a burst"):
        burst_steps(replace(probe, requests=[replace(requests[0], arrival_s=1.0)]), start)
