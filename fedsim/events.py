"""The virtual clock: a queue of timed callbacks run in time order (ties in the order they were
scheduled), so a run is a pure function of its inputs and seed."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from itertools import count

Callback = Callable[[], None]


class EventLoop:
    """Contract: `at(t, fn)` runs fn when the clock reaches t (never earlier than now);
    `run(until)` runs every event up to `until` in time order, then sets the clock there."""

    def __init__(self) -> None:
        self._now = 0.0
        self._queue: list[tuple[float, int, Callback]] = []
        self._order = count()
        self.events_run = 0
        self._stopped = False

    def now(self) -> float:
        return self._now

    def at(self, when: float, callback: Callback) -> None:
        heapq.heappush(self._queue, (max(when, self._now), next(self._order), callback))

    def after(self, delay: float, callback: Callback) -> None:
        self.at(self._now + delay, callback)

    def stop(self) -> None:
        """`run` returns after the event that called this."""
        self._stopped = True

    def run(self, until: float) -> None:
        queue = self._queue
        while queue and queue[0][0] <= until and not self._stopped:
            when, _, callback = heapq.heappop(queue)
            self._now = when
            callback()
            self.events_run += 1
        if not self._stopped:
            self._now = max(self._now, until)

    @property
    def pending(self) -> int:
        return len(self._queue)
