"""The per-minute counters shared limits keep (gateway/tenancy/minute_windows.py): how counts
roll from minute to minute, the sliding-minute estimate, and refusals whose Retry-After is the
first moment the same request fits."""

from __future__ import annotations

import pytest

from gateway.tenancy.minute_windows import MinuteClock, MinuteCounts, refusal


def test_clock_splits_unix_seconds_into_minute_and_share() -> None:
    clock = MinuteClock.at(125.0)
    assert clock.minute == 2
    assert clock.elapsed == pytest.approx(5 / 60)
    assert clock.previous_weight == pytest.approx(55 / 60)


@pytest.mark.parametrize(
    ("minute", "rolled"),
    [
        (10, MinuteCounts(10, 3, 30, 1, 10)),  # the same minute: as stored
        (9, MinuteCounts(10, 3, 30, 1, 10)),  # a lagging clock does not roll back
        (11, MinuteCounts(11, 0, 0, 3, 30)),  # the next minute: this one becomes the previous
        (12, MinuteCounts(12, 0, 0, 0, 0)),  # later: nothing counts any more
    ],
)
def test_counts_roll_by_minute(minute: int, rolled: MinuteCounts) -> None:
    assert MinuteCounts(10, 3, 30, 1, 10).at(minute) == rolled


def test_estimate_weighs_the_previous_minute_by_what_is_left_of_it() -> None:
    counts = MinuteCounts(10, 20, 200, 60, 600)
    assert counts.estimate("requests", MinuteClock(10, 0.0)) == pytest.approx(80)
    assert counts.estimate("requests", MinuteClock(10, 0.25)) == pytest.approx(65)
    assert counts.estimate("tokens", MinuteClock(10, 0.5)) == pytest.approx(500)


def test_a_request_that_fits_is_not_refused() -> None:
    counts = MinuteCounts(10, 2, 0, 4, 0)
    assert refusal(counts, MinuteClock(10, 0.5), "requests", 5, 1) is None  # 2 + 4/2 + 1 = 5


def test_a_request_larger_than_the_limit_never_fits() -> None:
    refused = refusal(MinuteCounts(10, 0, 0, 0, 0), MinuteClock(10, 0.5), "tokens", 100, 101)
    assert refused is not None
    assert refused.retry_after_s is None


CASES = [
    # (counts, clock, kind, limit, wanted): waits within this minute and into the next one.
    (MinuteCounts(10, 2, 0, 8, 0), MinuteClock(10, 0.1), "requests", 8, 1),
    (MinuteCounts(10, 0, 0, 10, 0), MinuteClock(10, 0.0), "requests", 10, 10),
    (MinuteCounts(10, 9, 0, 0, 0), MinuteClock(10, 0.3), "requests", 10, 2),
    (MinuteCounts(10, 0, 900, 0, 1000), MinuteClock(10, 0.5), "tokens", 1000, 400),
    (MinuteCounts(9, 0, 700, 0, 0), MinuteClock(10, 0.2), "tokens", 1000, 500),  # rolled first
]


@pytest.mark.parametrize(("counts", "clock", "kind", "limit", "wanted"), CASES)
def test_retry_after_is_the_first_moment_the_request_fits(
    counts: MinuteCounts, clock: MinuteClock, kind, limit: int, wanted: int
) -> None:
    refused = refusal(counts, clock, kind, limit, wanted)
    assert refused is not None
    assert refused.retry_after_s is not None
    start = clock.minute * 60 + clock.elapsed * 60

    def fits_at(seconds: float) -> bool:
        later = MinuteClock.at(start + seconds)
        return refusal(counts, later, kind, limit, wanted) is None

    assert fits_at(refused.retry_after_s + 1e-6)
    assert not fits_at(max(refused.retry_after_s - 0.5, 0.0))
