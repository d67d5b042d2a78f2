"""bench.engine.finetune_share_training.replayable keeps what a captured graph reads alive: the
closure holding its inputs (issue 70's part 3 crashed with an index_copy out of bounds when a
freed slot mapping's memory held the next batch's token ids). No CUDA here: the capture is
replaced by a stand-in graph, the bookkeeping under test is the same."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch

from bench.engine import finetune_share_training as training


class _Graph:
    def replay(self) -> None:
        pass

    def pool(self) -> None:
        return None


def _fake_capture(
    run: Callable[[], Any], pool: Any = None, before_capture: Callable[[], None] | None = None
) -> tuple[Any, Any]:
    return _Graph(), run()


def test_a_captured_run_keeps_its_inputs_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(training, "graph_of", _fake_capture)
    slots = torch.arange(8)
    watch = weakref.ref(slots)

    def forward(slots: torch.Tensor = slots) -> torch.Tensor:
        return slots * 2

    runnable = training.replayable(forward, torch.device("cuda"))
    del forward, slots
    gc.collect()
    assert runnable.mode == "cuda graph"
    assert watch() is not None, "the graph's input was freed while the graph can still replay"
    del runnable
    gc.collect()
    assert watch() is None  # held by the runnable only, not leaked


def test_a_failed_capture_runs_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(*_: Any, **__: Any) -> tuple[Any, Any]:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(training, "graph_of", failing)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    calls: list[int] = []
    runnable = training.replayable(lambda: calls.append(1), torch.device("cuda"))
    assert runnable.mode.startswith("eager (capture failed: RuntimeError")
    runnable.run()
    assert calls == [1]
