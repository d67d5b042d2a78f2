"""The garbage collector's pauses during a run: every thread stops while it walks the heap, so a
pause inside a serving step or between two is time the chat waits, whichever thread's
allocation set it off. bench.engine.finetune_colocated reports them beside the training pieces'
device time (a pause delays the host, not the device's queued work, so the pieces' figures do
not show it)."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

_LONG_MS = 10.0  # a pause as long as the training bound


@dataclass(slots=True)
class GcPauses:
    """A context: each collection's milliseconds and generation while it is open."""

    pauses: list[tuple[int, float]] = field(default_factory=list)
    ended_at: list[float] = field(default_factory=list)  # perf_counter at each pause's end
    _began: float = 0.0

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            now = time.perf_counter()
            self.pauses.append((int(info["generation"]), 1000 * (now - self._began)))
            self.ended_at.append(now)

    def within(self, began: float, ended: float) -> float:
        """Milliseconds of the pauses that ended within [began, ended] (perf_counter)."""
        return sum(ms for (_, ms), at in zip(self.pauses, self.ended_at, strict=True)
                   if began <= at <= ended)  # fmt: skip

    def summary(self) -> dict[str, Any]:
        times = [ms for _, ms in self.pauses]
        return {
            "collections": len(times),
            "total_ms": sum(times),
            "max_ms": max(times, default=0.0),
            f"over_{_LONG_MS:g}_ms": sum(ms > _LONG_MS for ms in times),
            "full_collections": sum(generation == 2 for generation, _ in self.pauses),
            "longest_full_ms": max((ms for g, ms in self.pauses if g == 2), default=0.0),
        }
