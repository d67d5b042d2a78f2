"""The per-minute counters that gateways sharing a PostgreSQL database keep for each key (pure).

Each key has the counts of the current minute and of the one before it. A sliding minute is
estimated from the two: the previous minute counts by the share of it still inside the sliding
minute (all of it at the start of this minute, none at its end), the current one in full:

    estimate = previous * (1 - elapsed fraction of this minute) + current

This is what the SQL of gateway/stores/key_limit_store.py evaluates atomically in the database;
these functions are the same arithmetic in Python, for the refusal's Retry-After and the tests
(tests/unit/test_minute_windows.py, and tests/integration/test_shared_limits.py, which checks
that the SQL and this module agree). The estimate is exact when usage within a minute is even,
and admits at most the limit in any whole clock minute; it never admits more than twice the
limit over any 60 s (the exact in-process window of limiter.py admits at most the limit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.tenancy.limiter import WINDOW_S, LimitKind, Refusal


@dataclass(frozen=True, slots=True)
class MinuteClock:
    """A moment, as the minute it falls in and how far into it."""

    minute: int
    # The share of the minute elapsed, in [0, 1).
    elapsed: float

    @classmethod
    def at(cls, unix_s: float) -> MinuteClock:
        minute = math.floor(unix_s / WINDOW_S)
        return cls(minute, unix_s / WINDOW_S - minute)

    @property
    def previous_weight(self) -> float:
        return 1.0 - self.elapsed


@dataclass(frozen=True, slots=True)
class MinuteCounts:
    minute: int
    requests: int
    tokens: int
    previous_requests: int
    previous_tokens: int

    def at(self, minute: int) -> MinuteCounts:
        """The counts as seen from `minute` (a later minute rolls them; an earlier one, a
        gateway whose clock is behind, sees them as they are)."""
        if minute <= self.minute:
            return self
        if minute == self.minute + 1:
            return MinuteCounts(minute, 0, 0, self.requests, self.tokens)
        return MinuteCounts(minute, 0, 0, 0, 0)

    def current(self, kind: LimitKind) -> int:
        return self.requests if kind == "requests" else self.tokens

    def previous(self, kind: LimitKind) -> int:
        return self.previous_requests if kind == "requests" else self.previous_tokens

    def estimate(self, kind: LimitKind, clock: MinuteClock) -> float:
        """The sliding minute's usage at `clock` (counts already rolled to its minute)."""
        return self.previous(kind) * clock.previous_weight + self.current(kind)


def refusal(
    counts: MinuteCounts, clock: MinuteClock, kind: LimitKind, limit: int, wanted: int
) -> Refusal | None:
    """Why `wanted` does not fit under `limit` now, with when it will if nothing else is charged
    (None: it fits). `counts` are rolled to the clock's minute."""
    counts = counts.at(clock.minute)
    used = counts.estimate(kind, clock)
    if used + wanted <= limit:
        return None
    if wanted > limit:
        return Refusal(kind, limit, math.ceil(used), wanted, None)
    wait_s = _wait_s(counts, clock, kind, limit, wanted)
    return Refusal(kind, limit, math.ceil(used), wanted, wait_s)


def _wait_s(
    counts: MinuteCounts, clock: MinuteClock, kind: LimitKind, limit: int, wanted: int
) -> float:
    room = limit - wanted - counts.current(kind)  # what the previous minute may still weigh
    previous = counts.previous(kind)
    left_in_minute = clock.previous_weight * WINDOW_S
    if room >= 0:
        # The previous minute fades linearly until it weighs no more than `room`.
        return max(left_in_minute - WINDOW_S * room / previous, 0.0) if previous else 0.0
    # This minute alone is over: wait for it to become the previous one, then for it to fade.
    current = counts.current(kind)
    return left_in_minute + WINDOW_S * max(1.0 - (limit - wanted) / current, 0.0)
