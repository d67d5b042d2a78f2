"""How many training rows (tokens of the job's current piece) ride with each serving step, so that
training never delays a serving step by more than `max_training_delay_ms` (issue 70).

Serving comes first: a step's token budget goes to the serving batch, training gets only the
room it leaves (budget minus serving tokens), and none at all while a request waits to be
admitted (a waiting request would be held up by the training rows). Within that room the rows
are the most the measured training time allows: after each step the training part's time is
observed; over the bound, the next step's rows shrink in proportion (with a margin) at once;
under it, they grow at most `growth`-fold a step towards what the bound allows. Every delay is
kept, so the longest one a run added to any serving step is known (the bench reports it).

No torch here: the bookkeeping is arithmetic, tested on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Sized to this share of the bound, not all of it: the time per row is an estimate.
_MARGIN = 0.8


@dataclass(slots=True)
class StepRows:
    max_training_delay_ms: float
    max_rows: int = 4096  # the most rows a step carries, whatever the room
    min_rows: int = 16  # fewer is all launches: a step then carries none
    growth: float = 2.0
    rows: int = field(init=False)  # the most the next step may carry (before the room)
    max_delay_ms: float = field(default=0.0, init=False)  # the longest delay observed
    over_bound: int = field(default=0, init=False)  # steps whose training outran the bound
    skipped_waiting: int = field(default=0, init=False)  # steps with none: a request waited
    steps_with_rows: int = field(default=0, init=False)
    rows_run: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if not self.max_training_delay_ms > 0 or not 1 <= self.min_rows <= self.max_rows:
            raise ValueError("StepRows needs a bound > 0 and 1 <= min_rows <= max_rows")
        if not self.growth > 1:
            raise ValueError("StepRows needs growth > 1")
        self.rows = self.min_rows  # the first step measures, then the rows follow the bound

    def for_step(self, serving_tokens: int, token_budget: int, waiting: int) -> int:
        """The training rows the step after one of `serving_tokens` (of `token_budget`) may
        carry: 0 while `waiting` requests wait, or when the room is below min_rows."""
        if waiting > 0:
            self.skipped_waiting += 1
            return 0
        room = token_budget - serving_tokens
        rows = min(self.rows, room)
        return rows if rows >= self.min_rows else 0

    def observe(self, rows: int, seconds: float) -> None:
        """The training part of a step carried `rows` rows and took `seconds`."""
        if rows < 1 or seconds < 0:
            raise ValueError(f"{rows} rows in {seconds} s cannot be observed")
        took_ms = 1000 * seconds
        self.max_delay_ms = max(self.max_delay_ms, took_ms)
        self.steps_with_rows += 1
        self.rows_run += rows
        bound = self.max_training_delay_ms
        fit = int(rows * _MARGIN * bound / took_ms) if took_ms else self.max_rows
        if took_ms > bound:
            self.over_bound += 1
            self.rows = max(self.min_rows, min(fit, rows - 1))
        else:
            self.rows = max(self.min_rows, min(self.max_rows, fit, int(self.rows * self.growth)))
