"""Which CUDA graphs remain to be captured, and whether to capture one now: lazy graphs.

A site with lazy graphs (EngineConfig.lazy_graphs) serves before any graph exists: every step
whose graph is missing runs eagerly, and the graphs are captured one at a time on the engine's
own thread between steps, never beside a step of ours on the device (no second thread: a
capture beside eager kernels of another thread is a concurrency hazard of its own). This module
decides when; the model runner's graph sets say what (a capture callable per graph, in order).

The policy: while the engine is idle, captures run back to back for up to `idle_budget_s` per
loop turn (at least one), so that a request arriving meanwhile waits for one capture at most;
while requests run, one capture per `busy_every_steps` steps, each costing that step its overlap
with the next and the capture's own time (tens of ms for a small model's decode graph).

Torch-free (scheduling imports no torch): the callables do the device work.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


def lazy_order(sizes: Sequence[int]) -> list[int]:
    """The order lazy graphs are captured in: the largest first, so that the memory pool grows
    to what the memory trial measured (its one graph is the largest) and every later graph
    reuses it as at an eager start; then the rest from the smallest up, because a new site's
    first steps are small batches (its first few requests)."""
    ordered = sorted(sizes)
    return ordered[-1:] + ordered[:-1]


@dataclass(frozen=True, slots=True)
class PendingGraph:
    """One graph to capture: `label` names it in logs and tests (e.g. "decode 8")."""

    label: str
    capture: Callable[[], None]


@dataclass(frozen=True, slots=True)
class CapturePolicy:
    # Requests running: one capture after every this many steps at most.
    busy_every_steps: int = 8
    # Engine idle: captures per loop turn until this many seconds were spent (at least one).
    idle_budget_s: float = 0.05

    def __post_init__(self) -> None:
        if self.busy_every_steps < 1 or not self.idle_budget_s > 0:
            raise ValueError("CapturePolicy needs busy_every_steps >= 1 and idle_budget_s > 0")


class GraphCaptureQueue:
    """Contract: `step_done()` after each engine step; `due(busy)` says whether a capture may
    run now; `capture(busy)` runs one (busy) or a time-bounded run of them (idle) and returns
    how many ran; `done` once none remain; `ready_s` the seconds from the queue's creation to
    its last capture (None until then). The caller guarantees no step of its own is queued on
    the device when it calls `capture`."""

    def __init__(
        self,
        pending: Iterable[PendingGraph] = (),
        policy: CapturePolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pending = list(pending)
        self._policy = policy or CapturePolicy()
        self._clock = clock
        self._began = clock()
        self._steps_since = 0
        self.captured: list[str] = []
        self.failed: list[str] = []
        self.ready_s: float | None = None if self._pending else 0.0

    def extend(self, pending: Iterable[PendingGraph]) -> None:
        """More graphs to capture, after those already queued."""
        self._pending.extend(pending)
        if self._pending:
            self.ready_s = None

    @property
    def remaining(self) -> tuple[str, ...]:
        return tuple(graph.label for graph in self._pending)

    @property
    def done(self) -> bool:
        return not self._pending

    def step_done(self) -> None:
        self._steps_since += 1

    def due(self, busy: bool) -> bool:
        if not self._pending:
            return False
        return not busy or self._steps_since >= self._policy.busy_every_steps

    def capture(self, busy: bool) -> int:
        """Captures what the policy allows now (nothing if not `due`); returns the count."""
        if not self.due(busy):
            return 0
        began = self._clock()
        count = 0
        while self._pending:
            graph = self._pending.pop(0)
            try:
                graph.capture()
            except Exception:
                # Not tried again: its steps stay eager (the caller logs why).
                self.failed.append(graph.label)
                self._finish()
                raise
            self.captured.append(graph.label)
            count += 1
            if busy or self._clock() - began >= self._policy.idle_budget_s:
                break
        self._finish()
        return count

    def _finish(self) -> None:
        self._steps_since = 0
        if not self._pending:
            self.ready_s = self._clock() - self._began
