"""Lazy graphs (PagedEngine's graph component): a CUDA site serves before its graphs are
captured, and captures them one at a time between steps while it serves (a step whose graph is
not captured yet runs eagerly: core/graph_capture.py paces the captures)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from site_engine.engine.core.graph_capture import CapturePolicy, GraphCaptureQueue
from site_engine.engine.model_runner import ModelRunner

log = logging.getLogger(__name__)


class LazyGraphs:
    """The graphs the runner still has to capture, and when to."""

    def __init__(self, runner: ModelRunner, pace: CapturePolicy) -> None:
        self._runner = runner
        self._pace = pace
        self.queue = GraphCaptureQueue(runner.pending_graphs(), pace)
        # Who hears that the start's graphs are all captured (their seconds since the start).
        self.on_ready: Callable[[float], None] | None = None

    @property
    def done(self) -> bool:
        return self.queue.done

    def due_after_step(self) -> bool:
        """A busy step ended: whether a capture is due now."""
        if self.queue.done:
            return False
        self.queue.step_done()
        return self.queue.due(busy=True)

    def capture(self, busy: bool) -> int:
        """Captures what is due (no step of the runner may be queued on the device); how many.
        A graph whose capture fails stays eager (logged)."""
        pending = not self.queue.done
        try:
            count = self.queue.capture(busy)
        except Exception:
            log.exception("capturing CUDA graph %s failed; its steps stay eager",
                          self.queue.failed[-1])  # fmt: skip
            count = 0
        if pending and self.queue.done:
            ready_s = self.queue.ready_s or 0.0
            log.info("graphs ready: %d CUDA graphs captured while serving, %.2f s after the "
                     "engine was built (%d failed, their steps eager)",
                     self._runner.num_graphs, ready_s, len(self.queue.failed))  # fmt: skip
            ready, self.on_ready = self.on_ready, None  # the start's graphs only
            if ready is not None:
                ready(ready_s)
        return count

    def resized(self, resize: Callable[[], None]) -> None:
        """Runs `resize` (the runner's cache changes size: its graphs are made again): the
        queue's callables hold the old graph sets (their memory pools), so they are dropped
        first; the graphs made again are captured again between steps, from the start."""
        self.queue = GraphCaptureQueue()
        try:
            resize()
        finally:
            self.queue = GraphCaptureQueue(self._runner.pending_graphs(), self._pace)

    def close(self) -> None:
        self.queue = GraphCaptureQueue()  # its callables capture into the runner's sets
