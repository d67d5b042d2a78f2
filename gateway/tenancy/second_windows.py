"""The sliding minute that gateways sharing a PostgreSQL database keep for each key (pure).

Each key's counters hold the requests and tokens charged in each of the last BUCKETS seconds
(Unix seconds): the current second and the 60 before it, oldest first. A charge is counted
while its second is among them, from when it is made until 60 to 61 s later, so when a request
is admitted every request admitted in the 60 s before it is counted: a key is never admitted
more than its limit within any 60 s (its tokens: within the overshoot allowed beside its
unsettled margins, gateway/tenancy/limiter.py). The price is a charge counted up to a second
longer than a minute: a client sending steadily gets at least 60/61 of its limit.

Issue 48, finding 2: the counters used to be clock minutes, the sliding minute estimated as
`previous minute x (share of it still inside) + this minute`; a client asking again at each
Retry-After from 0:59 on was admitted its limit at 0:59 and most of it again before 1:59 (1.86x
in 60 s; 1.6-1.7x measured on a deployment).

This is what the SQL of gateway/stores/key_limit_store.py evaluates atomically in the
database; these functions are the same arithmetic in Python, for a refusal's Retry-After and the
tests (tests/unit/test_second_windows.py, and tests/integration/test_shared_limits.py, which
checks that the SQL and this module agree).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.stores.key_limit_store import BUCKETS, KeyLimitsRow
from gateway.tenancy.limiter import LimitKind, Refusal

__all__ = ["BUCKETS", "BUCKET_S", "SecondCounts", "bucket_at", "most_refusal", "refusal"]
# The counts are per second: BUCKETS of them, the current second and the minute before it.
BUCKET_S = 1


def bucket_at(unix_s: float) -> int:
    return math.floor(unix_s / BUCKET_S)


@dataclass(frozen=True, slots=True)
class SecondCounts:
    """A key's requests and tokens per second, oldest first; the last is second `bucket`."""

    bucket: int
    requests: tuple[int, ...]
    tokens: tuple[int, ...]

    @classmethod
    def of(cls, row: KeyLimitsRow) -> SecondCounts:
        return cls(row.bucket, row.requests, row.tokens)

    @classmethod
    def empty(cls, bucket: int) -> SecondCounts:
        zeros = (0,) * BUCKETS
        return cls(bucket, zeros, zeros)

    def at(self, bucket: int) -> SecondCounts:
        """The counts as seen from second `bucket`: seconds that left the window dropped (a
        gateway whose clock is behind sees them as they are)."""
        shift = min(bucket - self.bucket, BUCKETS)
        if shift <= 0:
            return self
        zeros = (0,) * shift
        return SecondCounts(bucket, self.requests[shift:] + zeros, self.tokens[shift:] + zeros)

    def column(self, kind: LimitKind) -> tuple[int, ...]:
        return self.requests if kind == "requests" else self.tokens

    def used(self, kind: LimitKind) -> int:
        return sum(self.column(kind))

    def charged(self, bucket: int, requests: int, tokens: int) -> SecondCounts:
        """Rolled to `bucket`, with a charge in its newest second."""
        rolled = self.at(bucket)
        return SecondCounts(
            rolled.bucket,
            (*rolled.requests[:-1], rolled.requests[-1] + requests),
            (*rolled.tokens[:-1], rolled.tokens[-1] + tokens),
        )

    def settled(self, bucket: int, charged: int, delta: int) -> SecondCounts:
        """Rolled to `bucket`, with `delta` tokens corrected in second `charged` while it is
        counted; an overrun of a charge that is no longer counted counts now (so no request
        outlasts its way out of the limit), an over-charge of one is forgotten."""
        rolled = self.at(bucket)
        position = min(BUCKETS - 1 - (rolled.bucket - charged), BUCKETS - 1)
        if position < 0:
            if delta <= 0:
                return rolled
            position = BUCKETS - 1
        tokens = list(rolled.tokens)
        tokens[position] = max(tokens[position] + delta, 0)
        return SecondCounts(rolled.bucket, rolled.requests, tuple(tokens))

    def wait_s(self, unix_s: float, kind: LimitKind, excess: int) -> float | None:
        """How long until charges of `kind` totalling `excess` have left the window, seen at
        `unix_s` (counts rolled to its second); None if all of them are not enough."""
        freed = 0
        oldest = self.bucket - (BUCKETS - 1)
        for age, amount in enumerate(self.column(kind)):
            freed += amount
            if freed >= excess:
                # Second `oldest + age` is counted until the window's newest second is BUCKETS
                # later.
                return max((oldest + age + BUCKETS) * BUCKET_S - unix_s, 0.0)
        return None


def refusal(
    counts: SecondCounts, unix_s: float, kind: LimitKind, limit: int, wanted: int
) -> Refusal | None:
    """Why `wanted` does not fit under `limit` at `unix_s`, with when it will if nothing else is
    charged (None: it fits)."""
    counts = counts.at(bucket_at(unix_s))
    used = counts.used(kind)
    if used + wanted <= limit:
        return None
    if wanted > limit:
        return Refusal(kind, limit, used, wanted, None)
    wait_s = counts.wait_s(unix_s, kind, used + wanted - limit)
    assert wait_s is not None  # wanted <= limit: expiring every charge makes room
    return Refusal(kind, limit, used, wanted, wait_s)


def most_refusal(
    counts: SecondCounts, unix_s: float, margin: int, ceiling: int, tpm: int, most: int
) -> Refusal | None:
    """Why a request that may take `most` tokens does not fit beside the window's tokens and
    the key's unsettled margins within `ceiling` (the overshoot allowed over `tpm`): it fits
    once enough charges have left the window, or, if that is not enough, once some of the
    unsettled requests end (then a second)."""
    counts = counts.at(bucket_at(unix_s))
    held = counts.used("tokens") + margin
    excess = held + most - ceiling
    if excess <= 0:
        return None
    wait_s = counts.wait_s(unix_s, "tokens", excess)
    return Refusal("tokens", tpm, held, most, 1.0 if wait_s is None else wait_s)
