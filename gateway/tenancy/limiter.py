"""Per-key requests-per-minute and tokens-per-minute limits over a sliding window (pure).

Every admitted request leaves a charge (its time, requests and tokens) in its key's window; the
window's sums are what the limits are checked against. A charge's tokens are a prediction when
it is made and are settled to the real count when the request ends, so an over-prediction frees
budget at once and an under-prediction is paid for by the requests that follow. A refusal says
when enough of the window will have expired for the same request to fit, which is the earliest
moment a retry can succeed (later settlements can only move it by what they change).

Under-prediction is bounded as it happens (issue 32: a 700 tokens/min key ran 1,732 tokens in 25 s,
four requests predicted at 142 tokens that generated 400): an admission may also say the most
its request can take (prompt + max_tokens); what that exceeds its charge by is the request's
margin, held by its key until the request is settled. A request is admitted only if the window's
tokens, every unsettled margin and its own most fit within `overshoot` times the limit (1.2 by
default, GATEWAY_TOKEN_LIMIT_OVERSHOOT), so that whatever the predictions, the requests admitted
in any window take at most that much: near its limit a key is charged, in effect, its requests'
most rather than their predictions (bench/security/token_overshoot.py measures it).

No I/O and an injectable clock: the table-driven tests in tests/unit/test_limiter.py drive it.
This is per process: with several gateway replicas each enforces its own share of the limits.
A charge settled after it left the window is charged its overrun at settlement, so a request
that runs longer than the window is still paid for in full.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

WINDOW_S = 60.0
# The most the requests admitted in one window may take, as a multiple of the limit, whatever
# their answers' predicted lengths (GATEWAY_TOKEN_LIMIT_OVERSHOOT).
DEFAULT_OVERSHOOT = 1.2
Clock = Callable[[], float]
LimitKind = Literal["requests", "tokens"]


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-minute limits; None is unlimited."""

    requests_per_minute: int | None
    tokens_per_minute: int | None


@dataclass(slots=True)
class Charge:
    """What one admission took from a key's window; settle() corrects its tokens."""

    key_id: int
    at: float
    requests: int
    tokens: int
    # False once the charge left the window (or was settled): settling it then changes nothing.
    live: bool = True
    settled: bool = False
    # What the request may still take beyond `tokens` (its most less its charge), held by its
    # key until it is settled.
    margin: int = 0


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request does not fit now. retry_after_s is None when it never will: it alone asks
    for more than the limit."""

    kind: LimitKind
    limit: int
    used: int
    requested: int
    retry_after_s: float | None

    @property
    def retry_after_header(self) -> int | None:
        """Whole seconds for a Retry-After header, rounded up so a retry then fits."""
        if self.retry_after_s is None:
            return None
        return max(1, math.ceil(self.retry_after_s))


@dataclass(slots=True)
class _Window:
    charges: deque[Charge] = field(default_factory=deque)
    requests: int = 0
    tokens: int = 0
    # The margins of the key's unsettled charges (in the window or not: they are in flight).
    margin: int = 0


def _wait(refusal: Refusal) -> float:
    return math.inf if refusal.retry_after_s is None else refusal.retry_after_s


class SlidingWindowLimiter:
    def __init__(
        self,
        clock: Clock = time.monotonic,
        window_s: float = WINDOW_S,
        overshoot: float = DEFAULT_OVERSHOOT,
    ) -> None:
        self._clock = clock
        self._window_s = window_s
        self._overshoot = overshoot
        self._windows: dict[int, _Window] = {}

    def admit(
        self,
        key_id: int,
        limits: Limits,
        requests: int,
        tokens: int,
        most_tokens: int | None = None,
    ) -> Charge | Refusal:
        """Charges `requests` and `tokens` to the key if both fit its limits and, given the
        most the request can take (`most_tokens`), if that fits beside the window and every
        unsettled margin within `overshoot` times the tokens limit; else refuses and charges
        nothing."""
        now = self._clock()
        window = self._prune(key_id, now)
        tpm = limits.tokens_per_minute
        refusals = [
            refusal
            for refusal in (
                self._check(window, now, "requests", limits.requests_per_minute, requests),
                self._check(window, now, "tokens", tpm, tokens),
                self._check_most(window, now, tpm, most_tokens),
            )
            if refusal is not None
        ]
        if refusals:
            # The binding limit is the one that frees last (or never).
            return max(refusals, key=_wait)
        margin = max((most_tokens or 0) - tokens, 0) if tpm is not None else 0
        charge = Charge(key_id, now, requests, tokens, margin=margin)
        window.charges.append(charge)
        window.requests += requests
        window.tokens += tokens
        window.margin += margin
        return charge

    def _check_most(
        self, window: _Window, now: float, limit: int | None, most: int | None
    ) -> Refusal | None:
        """Whether the request's most fits beside the window's tokens and the unsettled
        margins, within the overshoot allowed; when not, waiting frees charges as they expire
        (margins only as their requests end: then a second)."""
        if limit is None or most is None or math.isinf(self._overshoot):
            return None
        ceiling = math.floor(self._overshoot * limit)
        excess = window.tokens + window.margin + most - ceiling
        if excess <= 0:
            return None
        held = window.tokens + window.margin
        freed = 0
        for charge in window.charges:
            freed += charge.tokens
            if freed >= excess:
                return Refusal("tokens", limit, held, most, charge.at + self._window_s - now)
        return Refusal("tokens", limit, held, most, 1.0)

    def settle(self, charge: Charge, tokens: int) -> None:
        """Replaces the charge's predicted tokens with the real count (once). A charge that has
        left the window (its request ran longer than the window) still pays what it overran:
        the excess is charged now, so no request outlasts its way out of the limit."""
        if charge.settled:
            return
        charge.settled = True
        overrun, now = tokens - charge.tokens, self._clock()
        window = self._windows.get(charge.key_id)  # None once the key was forgotten (revoked)
        if window is not None:
            window.margin -= charge.margin
            self._prune(charge.key_id, now)  # so `live` says whether it is in the window now
            if charge.live:
                window.tokens += overrun
            elif overrun > 0:
                window.charges.append(Charge(charge.key_id, now, 0, overrun, settled=True))
                window.tokens += overrun
        charge.tokens = tokens

    def used(self, key_id: int) -> tuple[int, int]:
        """(requests, tokens) charged to the key in the current window."""
        window = self._prune(key_id, self._clock())
        return window.requests, window.tokens

    def forget(self, key_id: int) -> None:
        """Drops a key's window (revoked keys admit nothing again)."""
        window = self._windows.pop(key_id, None)
        for charge in window.charges if window else ():
            charge.live = False

    def _prune(self, key_id: int, now: float) -> _Window:
        window = self._windows.setdefault(key_id, _Window())
        charges = window.charges
        while charges and charges[0].at <= now - self._window_s:
            old = charges.popleft()
            old.live = False
            window.requests -= old.requests
            window.tokens -= old.tokens
        return window

    def _check(
        self, window: _Window, now: float, kind: LimitKind, limit: int | None, wanted: int
    ) -> Refusal | None:
        if limit is None:
            return None
        used = window.requests if kind == "requests" else window.tokens
        excess = used + wanted - limit
        if excess <= 0:
            return None
        if wanted > limit:
            return Refusal(kind, limit, used, wanted, None)
        # Walk the window oldest first until what expires covers the excess.
        freed = 0
        for charge in window.charges:
            freed += charge.requests if kind == "requests" else charge.tokens
            if freed >= excess:
                return Refusal(kind, limit, used, wanted, charge.at + self._window_s - now)
        # Unreachable: the window's sum is its charges' sum and wanted <= limit, so expiring
        # every charge covers the excess.
        raise AssertionError("sliding window sums out of step with its charges")
