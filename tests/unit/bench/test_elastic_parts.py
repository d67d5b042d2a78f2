"""bench.elastic's parts that need no process: the stepped arrivals, GPU-seconds from the
timeline's samples, and the keys against static 2 sites."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.elastic.presets import PRESETS, Phase
from bench.elastic.report import goals_met, keys
from bench.elastic.run import merged_unit, with_gpus
from bench.elastic.summary import markdown, summarize
from bench.elastic.timeline import Sample, Timeline
from bench.elastic.workload import arrival_times


def test_arrivals_step_with_the_phases_and_repeat_for_a_seed() -> None:
    phases = (Phase(1, 200), Phase(3, 200), Phase(1, 200))
    times = arrival_times(phases, 2.0, seed=7)
    assert times == arrival_times(phases, 2.0, seed=7)
    assert times != arrival_times(phases, 2.0, seed=8)
    assert times == sorted(times)
    assert times[0] >= 0
    assert times[-1] < 600
    counts = [sum(lo <= t < lo + 200 for t in times) for lo in (0, 200, 400)]
    assert counts[0] == pytest.approx(400, rel=0.15)
    assert counts[1] == pytest.approx(1200, rel=0.1)
    assert counts[2] == pytest.approx(400, rel=0.15)


def test_site_seconds_integrate_the_processes_alive() -> None:
    timeline = Timeline("http://unused", ("a", "b"))
    timeline.samples = [Sample(0.0, 1, 1, None, None), Sample(10.0, 2, 1, 2, 1.0),
                        Sample(30.0, 1, 1, 1, 0.0)]  # fmt: skip
    # 1 site for 10 s, 2 for 20 s, 1 until the end at 40 s.
    assert timeline.site_seconds(40.0) == pytest.approx(10 + 40 + 10)
    assert timeline.site_seconds(20.0) == pytest.approx(10 + 20)


def test_keys_compare_the_autoscaled_arm_with_static2() -> None:
    auto = {"slo_attainment": 0.96, "site_seconds": 420.0, "lost": 0,
            "scale_out_to_serving_s": 31.5}  # fmt: skip
    static2 = {"slo_attainment": 1.0, "site_seconds": 620.0, "lost": 0}
    found = keys({"autoscaled": auto, "static2": static2})
    assert found == {
        "slo_attainment_vs_static2": 0.96,
        "gpu_seconds_vs_static2": 0.677,
        "lost_requests": 0,
        "scale_out_to_serving_s": 31.5,
    }
    assert set(goals_met(found).values()) == {True}
    alone = keys({"autoscaled": auto})
    assert alone["slo_attainment_vs_static2"] is None
    assert goals_met(alone)["gpu_seconds_vs_static2"] is None
    assert goals_met({**found, "lost_requests": 2})["lost_requests"] is False


def test_arms_side_by_side_take_gpus_of_their_own() -> None:
    preset = with_gpus(PRESETS["gpu"], "2,3")
    assert [dict(place.env)["CUDA_VISIBLE_DEVICES"] for place in preset.places] == ["2", "3"]
    assert preset.places[0].args == PRESETS["gpu"].places[0].args
    for bad in ("2", "2,3,4", "a,b"):
        with pytest.raises(ValueError, match="two device indexes"):
            with_gpus(PRESETS["gpu"], bad)


def test_merged_results_must_share_their_1x(tmp_path: Path) -> None:
    paths = []
    for i, unit in enumerate((1.5, 1.5, 2.0)):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps({"unit_rps": unit}))
    assert merged_unit(paths[:2]) == 1.5
    assert merged_unit([]) is None
    with pytest.raises(ValueError, match="different 1x"):
        merged_unit(paths)


def _seed_result(seed: int, slo_ratio: float, gpu_ratio: float) -> dict[str, object]:
    arm = {"slo_attainment": 0.9, "site_seconds": 100.0, "lost": 0, "requests": 10}
    return {
        "unit_rps": 3.0, "preset": "gpu", "phases": [{"multiple": 1, "seconds": 100}],
        "slo": {"ttft_s": 2.0, "tpot_s": 0.1}, "seed": seed, "commands": [f"run {seed}"],
        "arms": {"autoscaled": arm, "static2": arm},
        "slo_attainment_vs_static2": slo_ratio, "gpu_seconds_vs_static2": gpu_ratio,
        "lost_requests": 0, "scale_out_to_serving_s": 20.0,
    }  # fmt: skip


def test_a_goal_holds_only_if_every_seed_meets_it() -> None:
    summary = summarize({"s0": _seed_result(0, 0.99, 0.6), "s1": _seed_result(1, 0.93, 0.65)})
    slo = summary["keys"]["slo_attainment_vs_static2"]
    assert (slo["min"], slo["max"], slo["met_by_every_seed"]) == (0.93, 0.99, False)
    gpu = summary["keys"]["gpu_seconds_vs_static2"]
    assert (gpu["min"], gpu["max"], gpu["met_by_every_seed"]) == (0.6, 0.65, True)
    assert summary["arms"]["static2"]["s1"]["site_seconds"] == 100.0
    assert "| slo_attainment_vs_static2 | 0.990 | 0.930 |" in markdown(summary)
    other = _seed_result(2, 1.0, 0.5)
    other["unit_rps"] = 4.0
    with pytest.raises(ValueError, match="different 1x"):
        summarize({"s0": _seed_result(0, 0.99, 0.6), "s2": other})
