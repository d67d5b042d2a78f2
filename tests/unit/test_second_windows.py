"""The per-second counters shared limits keep (gateway/tenancy/second_windows.py): how counts
roll, what is counted, corrections, and that Retry-After is the first moment a refused request
fits."""

from __future__ import annotations

import pytest

from gateway.tenancy.second_windows import (
    BUCKETS,
    SecondCounts,
    bucket_at,
    most_refusal,
    refusal,
)

T = 1_740_000_000  # some second of 2025


def counts_with(bucket: int, **by_age: int) -> SecondCounts:
    """Tokens (and one request each) charged `age` seconds before `bucket`: counts_with(T, a3=5)."""
    tokens = [0] * BUCKETS
    for name, amount in by_age.items():
        tokens[BUCKETS - 1 - int(name[1:])] = amount
    requests = tuple(1 if amount else 0 for amount in tokens)
    return SecondCounts(bucket, requests, tuple(tokens))


def test_a_minute_and_the_current_second() -> None:
    assert BUCKETS == 61
    assert bucket_at(T + 0.999) == T


@pytest.mark.parametrize(
    ("bucket", "used"),
    [
        (T - 5, 111),  # a lagging clock sees the counts as they are
        (T, 111),
        (T + 1, 11),  # the charge of T - 60 was counted for 61 s
        (T + 50, 11),
        (T + 51, 1),
        (T + 60, 1),
        (T + 61, 0),
        (T + 500, 0),
    ],
)
def test_a_charge_counts_for_a_minute_and_at_most_a_second_more(bucket: int, used: int) -> None:
    assert counts_with(T, a60=100, a10=10, a0=1).at(bucket).used("tokens") == used


def test_charging_rolls_then_adds_to_the_current_second() -> None:
    counts = counts_with(T, a60=100, a0=1).charged(T + 2, 1, 7)
    assert counts.bucket == T + 2
    assert counts.tokens[-3:] == (1, 0, 7)
    assert counts.used("tokens") == 8  # the 100 of T - 60 left the window
    assert counts.used("requests") == 2


@pytest.mark.parametrize(
    ("charged", "delta", "used"),
    [
        (T - 30, 50, 160),  # still counted: corrected where it was charged
        (T - 30, -200, 10),  # never below nothing
        (T - 61, 50, 160),  # no longer counted: an overrun counts now
        (T - 61, -50, 110),  # ... an over-charge is forgotten
    ],
)
def test_settling_corrects_the_second_it_was_charged_in(charged: int, delta: int, used: int):
    counts = counts_with(T, a30=100, a0=10).settled(T, charged, delta)
    assert counts.used("tokens") == used
    assert counts.used("requests") == 2


def test_a_request_larger_than_the_limit_never_fits() -> None:
    refused = refusal(SecondCounts.empty(T), T + 0.5, "tokens", 100, 101)
    assert refused is not None
    assert refused.retry_after_s is None


CASES = [
    # (counts, at, kind, limit, wanted)
    (counts_with(T, a0=700), T + 0.5, "tokens", 700, 100),  # the whole minute just now: 60.5 s
    (counts_with(T, a59=300, a20=300, a0=100), T + 0.25, "tokens", 700, 250),
    (counts_with(T, a60=3, a1=4), T + 0.9, "tokens", 7, 1),
    (counts_with(T, a60=3, a1=4), T + 0.9, "requests", 2, 1),
    (counts_with(T - 30, a0=600), T, "tokens", 700, 200),  # rolled first
]


@pytest.mark.parametrize(("counts", "at", "kind", "limit", "wanted"), CASES)
def test_retry_after_is_the_first_moment_the_request_fits(
    counts: SecondCounts, at: float, kind, limit: int, wanted: int
) -> None:
    refused = refusal(counts, at, kind, limit, wanted)
    assert refused is not None
    assert refused.retry_after_s is not None

    def fits_at(seconds: float) -> bool:
        return refusal(counts, at + seconds, kind, limit, wanted) is None

    assert fits_at(refused.retry_after_s + 1e-6)
    assert not fits_at(max(refused.retry_after_s - 0.01, 0.0))


def test_the_most_waits_for_charges_to_leave_or_for_margins_to_come_back() -> None:
    counts = counts_with(T, a30=400)
    assert most_refusal(counts, T, 0, 840, 700, 440) is None
    refused = most_refusal(counts, T, 0, 840, 700, 441)
    assert refused is not None
    assert refused.retry_after_s == pytest.approx(31)  # the 400 of T - 30 leave at T + 31
    waiting_on_margins = most_refusal(counts, T, 500, 840, 700, 441)
    assert waiting_on_margins is not None
    assert waiting_on_margins.retry_after_s == 1.0  # the window alone cannot make room
