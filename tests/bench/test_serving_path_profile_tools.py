"""The serving path's profiling tools: py-spy windows split by thread (pyspy_split) and the
switch-interval bench's one point (gil_handoff)."""

from __future__ import annotations

import sys
from pathlib import Path

from bench.serving_path import gil_handoff, pyspy_split

RAW = """\
thread (101): engine-loop;Thread.run (threading.py:982);EngineService._run (site_engine/engine_service.py:361);Roster.stats (site_engine/engine/core/scheduling/roster.py:245) 30
thread (101): engine-loop;Thread.run (threading.py:982);EngineService._run (site_engine/engine_service.py:361);Event.synchronize (torch/cuda/streams.py:254) 10
thread (202): MainThread;<module> (site_engine/__main__.py:9);BaseEventLoop.run_forever (asyncio/base_events.py:608);_deliver (site_engine/engine_service.py:525) 40
thread (303): grpc;Thread.run (threading.py:982);poll (grpc/_cython.py:1) 20
"""  # noqa: E501


def test_a_window_s_samples_split_by_thread_role_and_function(tmp_path: Path) -> None:
    stacks = pyspy_split.parse(RAW.splitlines())
    assert [count for _, _, count in stacks] == [30, 10, 40, 20]
    assert pyspy_split.roles(stacks) == {"101": "engine", "202": "event loop", "303": "other"}
    text = pyspy_split.window_markdown("w00_gil", stacks, top=5)
    assert "| engine | 40.0% |" in text
    assert "| event loop | 40.0% |" in text
    assert "- 30.0% `Roster.stats (site_engine/engine/core/scheduling/roster.py:245)`" in text
    (tmp_path / "w00_gil.txt").write_text(RAW)
    (tmp_path / "windows.txt").write_text("w00_gil 12\n")
    out = tmp_path / "split.md"
    assert pyspy_split.main([str(tmp_path), "--out", str(out)]) == 0
    assert out.read_text().startswith("### w00_gil (from 12 s)")


def test_one_point_of_the_switch_interval_bench_steps_the_real_scheduler() -> None:
    before = sys.getswitchinterval()
    try:
        figures = gil_handoff.point(rows=600, interval_s=1e-3, busy=True, seconds=0.3)
    finally:
        sys.setswitchinterval(before)
    assert figures["step_p50_s"] > 0
    assert figures["busy_units_per_s"] > 0
