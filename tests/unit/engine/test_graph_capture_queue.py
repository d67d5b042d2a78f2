"""The lazy graphs' capture queue (site_engine/engine/core/graph_capture.py): which graph next,
and whether one may be captured now, idle or busy. Torch-free, with a clock of the test's own."""

from __future__ import annotations

from functools import partial

import pytest

from site_engine.engine.core.graph_capture import (
    CapturePolicy,
    GraphCaptureQueue,
    PendingGraph,
    lazy_order,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def graphs(labels: list[str], calls: list[str], clock: Clock, each_s: float) -> list[PendingGraph]:
    def capture(label: str) -> None:
        calls.append(label)
        clock.now += each_s

    return [PendingGraph(label, partial(capture, label)) for label in labels]


def test_lazy_order_takes_the_largest_first_then_the_smallest_up() -> None:
    assert lazy_order([1, 2, 4, 8, 16]) == [16, 1, 2, 4, 8]
    assert lazy_order([16, 4, 1]) == [16, 1, 4]
    assert lazy_order([8]) == [8]
    assert lazy_order([]) == []


def test_idle_turns_capture_until_the_time_budget_then_stop() -> None:
    clock, calls = Clock(), list[str]()
    labels = [f"g{i}" for i in range(7)]
    queue = GraphCaptureQueue(
        graphs(labels, calls, clock, each_s=0.02), CapturePolicy(idle_budget_s=0.05), clock
    )
    assert queue.due(busy=False)
    assert not queue.done
    assert queue.ready_s is None
    assert queue.capture(busy=False) == 3  # 0.02, 0.04, 0.06 >= 0.05: stop
    assert calls == labels[:3]
    assert queue.remaining == tuple(labels[3:])
    assert queue.capture(busy=False) == 3
    assert queue.capture(busy=False) == 1
    assert calls == labels
    assert queue.captured == labels
    assert queue.done
    assert not queue.due(busy=False)
    assert queue.ready_s == pytest.approx(7 * 0.02)
    assert queue.capture(busy=False) == 0


def test_an_idle_turn_captures_one_even_when_it_outlasts_the_budget() -> None:
    clock, calls = Clock(), list[str]()
    queue = GraphCaptureQueue(graphs(["a", "b"], calls, clock, each_s=1.0), clock=clock)
    assert queue.capture(busy=False) == 1
    assert calls == ["a"]


def test_busy_engine_captures_one_graph_per_n_steps() -> None:
    clock, calls = Clock(), list[str]()
    queue = GraphCaptureQueue(
        graphs(["a", "b", "c"], calls, clock, each_s=0.0),
        CapturePolicy(busy_every_steps=3),
        clock,
    )
    captured_at = []
    for step in range(1, 13):
        queue.step_done()
        if queue.due(busy=True):
            assert queue.capture(busy=True) == 1  # one only, however fast
            captured_at.append(step)
    assert captured_at == [3, 6, 9]
    assert calls == ["a", "b", "c"]
    assert queue.done
    assert queue.capture(busy=True) == 0


def test_a_busy_capture_is_not_due_before_its_steps_and_idle_is_always_due() -> None:
    clock, calls = Clock(), list[str]()
    queue = GraphCaptureQueue(
        graphs(["a", "b"], calls, clock, each_s=0.0), CapturePolicy(busy_every_steps=2), clock
    )
    queue.step_done()
    assert not queue.due(busy=True)
    assert queue.capture(busy=True) == 0
    assert queue.due(busy=False)
    assert queue.capture(busy=False) == 2
    assert calls == ["a", "b"]


def test_a_failed_capture_is_dropped_and_reported_the_rest_go_on() -> None:
    clock, calls = Clock(), list[str]()

    def broken() -> None:
        raise RuntimeError("capture failed")

    queue = GraphCaptureQueue(
        [PendingGraph("bad", broken), *graphs(["ok"], calls, clock, each_s=0.0)], clock=clock
    )
    with pytest.raises(RuntimeError, match="capture failed"):
        queue.capture(busy=False)
    assert queue.failed == ["bad"]
    assert queue.remaining == ("ok",)
    assert queue.capture(busy=False) == 1
    assert queue.done
    assert queue.captured == ["ok"]
    assert calls == ["ok"]


def test_an_empty_queue_is_ready_at_once_and_extend_reopens_it() -> None:
    clock, calls = Clock(), list[str]()
    queue = GraphCaptureQueue(clock=clock)
    assert queue.done
    assert queue.ready_s == 0.0
    assert not queue.due(busy=False)
    queue.extend(graphs(["x"], calls, clock, each_s=0.5))
    assert not queue.done
    assert queue.ready_s is None
    assert queue.capture(busy=False) == 1
    assert queue.ready_s == pytest.approx(0.5)


def test_policy_is_validated() -> None:
    with pytest.raises(ValueError, match="busy_every_steps >= 1"):
        CapturePolicy(busy_every_steps=0)
    with pytest.raises(ValueError, match="idle_budget_s > 0"):
        CapturePolicy(idle_budget_s=0.0)
