"""A batch's progress and the time it has left, from the tokens its plan expects: each item
weighs its prompt plus its planned answer (the prediction capped at max_tokens, else
max_tokens), so a batch of long answers does not look nearly done when its short items are."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True, slots=True)
class Progress:
    planned_tokens: int  # every item's prompt + planned answer
    finished_tokens: int  # those of the items that are final
    eta_s: float | None  # None until some work has finished, or once all has

    @property
    def fraction(self) -> float:
        return self.finished_tokens / self.planned_tokens if self.planned_tokens else 1.0


def estimate(
    planned_tokens: int, finished_tokens: int, started_at: datetime | None, now: datetime
) -> Progress:
    """Contract: eta_s is the planned tokens left at the rate the batch has finished tokens
    since it started (in_progress_at); None without a start, without finished work, or with
    nothing left."""
    left = planned_tokens - finished_tokens
    eta: float | None = None
    if started_at is not None and finished_tokens > 0 and left > 0:
        elapsed = max((now - started_at).total_seconds(), 1e-3)
        eta = left / (finished_tokens / elapsed)
    return Progress(planned_tokens, finished_tokens, eta)
