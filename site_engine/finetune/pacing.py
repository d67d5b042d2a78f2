"""How many tokens the next unit of training may take, so that it stays under the time bound.

A unit's time is close to linear in its tokens (padded rows x width) over the range a bound of
tens to hundreds of milliseconds allows, so the pacer keeps an exponentially weighted mean of
the seconds per token of the units run, and sizes the next unit as bound / that. A fixed cost
per unit (the weights read once per forward and backward) makes small units look dear per
token; sizing by bound / (a/U + b) still converges to the U where a + b*U meets the bound, from
below, so it errs on the short side. The budget grows at most `growth`-fold a unit, since the
per-token cost measured at one size is only a guide for sizes far from it (attention is
quadratic, memory traffic is not). With nothing measured yet the next unit's time is unknown,
which the gate treats as too long to run beside requests (`predict_s` is infinite).

No torch here: the pacer is arithmetic, tested on its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(slots=True)
class UnitPacer:
    bound_s: float
    smoothing: float = 0.3  # weight of the newest unit in the mean
    growth: float = 2.0  # the most the budget may grow from one unit to the next
    seconds_per_token: float | None = field(default=None, init=False)
    # What the last unit was allowed, or ran when one example was longer (0: none yet).
    budget: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if not self.bound_s > 0 or not 0 < self.smoothing <= 1 or not self.growth > 1:
            raise ValueError("UnitPacer needs bound_s > 0, smoothing in (0, 1] and growth > 1")

    def next_budget(self, cap: int) -> int:
        """The most tokens the next unit may take (>= 1, <= cap). The trainer still takes one
        whole sequence when it is longer than this: a sequence is never cut."""
        if cap < 1:
            raise ValueError(f"a unit's token cap must be >= 1, not {cap}")
        if self.seconds_per_token is None:
            return 1  # the first unit: one sequence, whatever it costs, then measured
        budget = int(self.bound_s / self.seconds_per_token)
        if self.budget:
            budget = min(budget, int(self.budget * self.growth))
        return max(1, min(budget, cap))

    def predict_s(self, tokens: int) -> float:
        """The seconds a unit of `tokens` is expected to take (infinite before any unit ran)."""
        if self.seconds_per_token is None:
            return math.inf
        return tokens * self.seconds_per_token

    def observe(self, budget: int, tokens: int, seconds: float) -> None:
        """A unit sized `budget` (next_budget's) computed `tokens` in `seconds`."""
        if budget < 1 or tokens < 1 or seconds < 0:
            raise ValueError(f"a unit of {tokens} tokens in {seconds} s cannot be measured")
        self.budget = max(budget, tokens)  # an example over the budget ran: grow from it
        rate = seconds / tokens
        old = self.seconds_per_token
        self.seconds_per_token = rate if old is None else old + self.smoothing * (rate - old)
