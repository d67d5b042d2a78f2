"""A site's start broken into phases (site_engine/start_phases.py) and the KV plans a pooled
start reads instead of running the memory trial (site_engine/kv_plan_record.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from site_engine.engine.memory_plan import KvPlan, TrialMeasurement
from site_engine.kv_plan_record import plan_key, record_plan, recorded_plan
from site_engine.settings import SettingsError, SiteSettings
from site_engine.start_phases import StartPhaseCollector, StartPhases, process_age_s


def test_phases_are_the_seconds_between_marks_and_the_log_line_says_them() -> None:
    phases = StartPhases(time.monotonic() - 2.0)
    phases.mark("imports")
    time.sleep(0.02)
    phases.mark("weights_read")
    (imports, first), (weights, second) = phases.phases()
    assert (imports, weights) == ("imports", "weights_read")
    assert 2.0 <= first < 3.0
    assert 0.02 <= second < 1.0
    assert phases.total_s == first + second
    assert phases.line().startswith("start phases: imports 2.")
    assert "weights_read 0.0" in phases.line()


def test_a_process_is_older_than_zero_and_its_imports_count_from_its_start() -> None:
    assert process_age_s() > 0.0  # this test process started before this line
    phases = StartPhases.since_process_start()
    assert phases.mark("imports") >= process_age_s() - 0.1


def test_the_metric_carries_every_phase() -> None:
    phases = StartPhases(time.monotonic() - 1.5)
    phases.mark("imports")
    registry = CollectorRegistry()
    registry.register(StartPhaseCollector("s1", phases))
    text = generate_latest(registry).decode()
    assert 'fedllm_site_start_phase_seconds{phase="imports",site="s1"} 1.5' in text


def test_a_recorded_plan_is_read_back_whole_under_its_key(tmp_path: Path) -> None:
    measurement = TrialMeasurement(80 << 30, 70 << 30, 1 << 30, 2 << 30, 1 << 20, 12)
    plan = KvPlan(1000, 16, 4096, 2048, measurement, 4 << 30)
    key = plan_key("NVIDIA H100", tmp_path, "bfloat16", max_num_seqs=64, block_size=16)
    path = tmp_path / "plans" / "kv-plans.json"
    assert recorded_plan(path, key) is None  # no file yet: the trial runs
    record_plan(path, key, plan)
    record_plan(path, "another", KvPlan(5, 16, 4096, 2048, None, 0))
    assert recorded_plan(path, key) == plan
    other = plan_key("NVIDIA H100", tmp_path, "bfloat16", max_num_seqs=128, block_size=16)
    assert recorded_plan(path, other) is None  # other settings: another trial


def test_an_unreadable_plan_file_means_a_trial_not_a_failed_start(tmp_path: Path) -> None:
    path = tmp_path / "kv-plans.json"
    path.write_text("{not json")
    assert recorded_plan(path, "k") is None
    path.write_text('{"k": {"num_blocks": 3}}')
    assert recorded_plan(path, "k") is None


def test_graphs_ready_comes_after_ready_in_the_metric_not_in_the_start_total() -> None:
    """Lazy graphs: the last graph is captured while the site serves; its time is reported
    apart from the start (whose total the bench compares) and in the gauge."""
    phases = StartPhases(time.monotonic() - 1.0)
    phases.mark("grpc_up")
    total = phases.total_s
    time.sleep(0.02)
    seconds = phases.after_ready("graphs_ready")
    assert seconds >= 0.02
    assert phases.total_s == total
    assert "graphs_ready" not in phases.line()
    assert phases.after() == [("graphs_ready", seconds)]
    registry = CollectorRegistry()
    registry.register(StartPhaseCollector("s1", phases))
    text = generate_latest(registry).decode()
    assert 'fedllm_site_start_phase_seconds{phase="graphs_ready",site="s1"}' in text


def test_lazy_graphs_are_refused_on_a_cpu_site(tmp_path: Path) -> None:
    env = {"SITE_MODEL_DIR": str(tmp_path), "SITE_LAZY_GRAPHS": "true"}
    with pytest.raises(SettingsError, match="SITE_LAZY_GRAPHS needs SITE_DEVICE=cuda"):
        SiteSettings.load(env)
    assert SiteSettings.load({**env, "SITE_DEVICE": "cuda:0"}).lazy_graphs
    assert not SiteSettings.load({"SITE_MODEL_DIR": str(tmp_path)}).lazy_graphs


def test_a_cuda_site_serves_before_its_graphs_unless_told_not_to(tmp_path: Path) -> None:
    env = {"SITE_MODEL_DIR": str(tmp_path), "SITE_DEVICE": "cuda:0"}
    assert SiteSettings.load(env).lazy_graphs
    assert not SiteSettings.load({**env, "SITE_LAZY_GRAPHS": "false"}).lazy_graphs
    assert not SiteSettings.load(env, lazy_graphs=False).lazy_graphs
