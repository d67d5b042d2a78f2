"""bench.elastic's parts that need no process: the stepped arrivals, GPU-seconds from the
timeline's samples, and the keys against static 2 sites."""

from __future__ import annotations

import pytest

from bench.elastic.presets import Phase
from bench.elastic.report import goals_met, keys
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
