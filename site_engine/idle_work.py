"""Work the engine loop runs in the cycles inference leaves idle: the lowest class of all.

Fine-tuning (site_engine/finetune/jobs.py) is such work. It runs on the engine's own thread,
between model steps, so it never races a step for the model or the device and never holds the
asyncio loop that serves gRPC. The gate is FineInfer's deferral rule: a unit runs only while no
request of any class waits to be admitted (a waiting request would be held up by a whole unit),
and, while requests are running, only if the NEXT unit is predicted to take no longer than the
bound: each running request's next token is then late by one bounded unit at most. The work
predicts from what its recent units measured and sizes its units to the bound
(site_engine/finetune/pacing.py), so one slow unit shrinks the next ones instead of closing the
gate; a unit it cannot predict (nothing measured yet) or cannot make short enough (one sequence
alone is longer) runs only while no request is in at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from site_engine.engine.core.api import EngineStats


class IdleWork(Protocol):
    def has_work(self) -> bool:
        """Whether a unit is ready to run (any thread may ask; it must be cheap)."""
        ...

    def next_unit_s(self) -> float:
        """The seconds the next unit is expected to take (the engine's thread asks; may be
        math.inf when unknown)."""
        ...

    def run_unit(self) -> float:
        """Runs one unit on the engine's thread; returns the seconds it took."""
        ...


@dataclass(frozen=True, slots=True)
class IdleGate:
    max_unit_s: float

    def allows(self, stats: EngineStats, next_unit_s: float) -> bool:
        if stats.num_waiting > 0:
            return False
        return stats.num_running == 0 or next_unit_s <= self.max_unit_s
