"""Work the engine loop runs in the cycles inference leaves idle: the lowest class of all.

Fine-tuning (site_engine/finetune/jobs.py) is such work. It runs on the engine's own thread,
between model steps, so it never races a step for the model or the device and never holds the
asyncio loop that serves gRPC. The gate is FineInfer's deferral rule: a unit runs only while no
request of any class waits to be admitted (a waiting request would be held up by a whole unit),
and, while requests are running, only if the NEXT unit is predicted to take no longer than the
bound: each running request's next token is then late by one bounded unit at most. The work
predicts from what its recent units measured and sizes its units to the bound
(site_engine/finetune/pacing.py), so one slow unit shrinks the next ones instead of closing the
gate. A unit it cannot predict (nothing measured yet) or cannot make short enough (one sequence
alone is longer than the bound allows) runs at once while no request is in, and beside running
requests only once the work has been held back `patience` times its predicted length (the
bound's, when unknown) since its last unit: under steady load it is not starved for good, and
such units take at most 1 / (1 + patience) of the engine's time. With no request in at all the
work is told so (`run_unit(alone=True)`): fine-tuning then begins units of thousands of tokens
(no time bound on the unit), still run in bounded pieces, so a request arriving meanwhile waits
for the piece under way, not for the unit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from site_engine.engine.core.api import EngineStats

# A site's default busy share (SITE_FINETUNE_BUSY_SHARE): the same 15% of an interactive step that
# background rows may add to it (SITE_DEFERRAL_BOUND_SLACK).
DEFAULT_BUSY_SHARE = 0.15


class IdleWork(Protocol):
    def has_work(self) -> bool:
        """Whether a unit is ready to run (any thread may ask; it must be cheap)."""
        ...

    def next_unit_s(self) -> float:
        """The seconds the next unit is expected to take (the engine's thread asks; may be
        math.inf when unknown)."""
        ...

    def run_unit(self, alone: bool) -> float:
        """Runs one unit (or a piece of one) on the engine's thread; returns the seconds it
        took. `alone`: no request waits or runs, so the work may begin a unit larger than the
        bound (fine-tuning's idle-sized units) as long as what this call runs stays bounded."""
        ...


@dataclass(frozen=True, slots=True)
class IdleGate:
    max_unit_s: float
    patience: float = 4.0
    # The most of the engine's time units within the bound may take while requests run: a
    # unit then waits (1 - share) / share times its predicted length after the last one ended.
    # 1.0 is FineInfer's rule alone (a unit between every two steps).
    busy_share: float = 1.0
    # Waiting requests that do not close the gate: those the next step admits anyway (rows
    # mode's NextStep.admits_waiting: they wait for one bounded piece, as running ones do).
    # None: any waiting request closes it (FineInfer's rule).
    admits_waiting: Callable[[EngineStats], bool] | None = None

    def __post_init__(self) -> None:
        if not self.max_unit_s > 0 or not self.patience > 0 or not 0 < self.busy_share <= 1:
            raise ValueError("IdleGate needs max_unit_s > 0, patience > 0 and busy_share in (0, 1]")

    def allows(self, stats: EngineStats, next_unit_s: float, held_s: float = 0.0) -> bool:
        """Whether the next unit, predicted to take `next_unit_s`, may run now, `held_s` after
        the work's last unit ended."""
        if stats.num_waiting > 0 and not (
            self.admits_waiting is not None and self.admits_waiting(stats)
        ):
            return False
        if stats.num_running == 0:
            return True
        if next_unit_s <= self.max_unit_s:
            return held_s >= next_unit_s * (1 - self.busy_share) / self.busy_share
        cost = next_unit_s if math.isfinite(next_unit_s) else self.max_unit_s
        return held_s >= self.patience * cost
