"""Slowing running sites down from outside, the way a noisy neighbour or a CPU-throttled VM
does: the processes are stopped (SIGSTOP) for a share of every short period and resumed
(SIGCONT) for the rest. A site stays reachable and keeps reporting load, only slower."""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass, field

_ACTIVE: set[Throttle] = set()


def stop_all() -> None:
    """Ends every throttle still running (an interrupted run must not leave sites stopped)."""
    for throttle in list(_ACTIVE):
        throttle.stop()


@dataclass(eq=False)
class Throttle:
    pids: tuple[int, ...]
    stopped_share: float  # 0.8: the processes run 20% of the time, about 5x slower
    period_s: float = 0.05
    _halt: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        if not 0 < self.stopped_share < 1 or self.period_s <= 0:
            raise ValueError("stopped_share must be in (0, 1) and period_s > 0")

    @property
    def active(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        if self._thread is None:
            _ACTIVE.add(self)
            self._thread = threading.Thread(target=self._cycle, name="throttle", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Ends the throttling and leaves the processes running."""
        self._halt.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._signal(signal.SIGCONT)
        _ACTIVE.discard(self)

    def _cycle(self) -> None:
        stopped = self.period_s * self.stopped_share
        running = self.period_s - stopped
        while not self._halt.is_set():
            self._signal(signal.SIGSTOP)
            self._halt.wait(stopped)
            self._signal(signal.SIGCONT)
            self._halt.wait(running)

    def _signal(self, sig: signal.Signals) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                continue  # it exited (e.g. a site killed on purpose): nothing to slow down
