"""Shortest predicted first with aging and a hard bound on overtaking: the one rule the sites'
waiting queues (site_engine/engine/core/scheduling_policy.py) and the gateway's queue
(gateway/routing/hold_order.py) order requests by within a priority class.

A request's rank is its expected answer length plus `aging` tokens for each request that arrived
before it (its arrival index i): rank = min(L, cap) + aging * i, lower first, ties by arrival.
A long request can only starve while new, shorter ones keep coming; the aging puts it ahead of
every later arrival once (L - 1) / aging more have come. `max_overtakes` (K) makes that a hard
bound whatever the prediction: the length ranked by is capped at 0.75 + aging * (K + 1), so only
the K arrivals right after a request can rank ahead of it (a later one, of expected length >= 1,
ranks at >= 1 + aging * (i + K + 1) > cap + aging * i): at most K requests that arrived after it
are served before it. The 0.25 below the boundary keeps float rounding from deciding it.
Predictions longer than the cap rank among themselves first come, first served.

The bound is made of the aging: with aging 0 (pure SPF) there is no arrival term to bound by,
and no bound holds. A rank never changes while the request waits, so a queue can keep its order
by binary insertion instead of sorting.
"""

from __future__ import annotations

# The sites' and the gateway's default bound (SchedulerConfig.spf_max_overtakes,
# GATEWAY_QUEUE_MAX_OVERTAKES) and aging (tokens of rank per earlier arrival).
DEFAULT_MAX_OVERTAKES = 256
DEFAULT_AGING = 1.0


def length_cap(aging: float, max_overtakes: int | None) -> float:
    """The longest expected length a request ranks by (inf: no cap); ValueError for a bound < 0."""
    if max_overtakes is not None and max_overtakes < 0:
        raise ValueError(f"the overtaking bound must be >= 0 or None, got {max_overtakes}")
    if max_overtakes is None or aging <= 0:
        return float("inf")
    return 0.75 + aging * (max_overtakes + 1)


def rank(expected_tokens: int, arrival_index: int, aging: float, cap: float) -> float:
    """A request's rank (lower is served first), fixed while it waits."""
    return min(expected_tokens, cap) + aging * arrival_index
