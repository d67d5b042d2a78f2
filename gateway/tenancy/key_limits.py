"""Where a key's limits are counted: in this process (LocalKeyLimits, the embedded SQLite
deployment, one gateway), or in PostgreSQL for every gateway of the deployment together
(SharedKeyLimits in shared_limits.py). Both give the same answers to the same questions:
admit a request (its requests, tokens and, for a key with a concurrency cap, a slot), then
settle it to what it really took and give the slot back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from gateway.tenancy.concurrency import InFlightCounter, Slot
from gateway.tenancy.keys import KeyRecord
from gateway.tenancy.limiter import Charge, LimitKind, Limits, Refusal, SlidingWindowLimiter


@dataclass(frozen=True, slots=True)
class InFlightRefusal:
    """The key already has `limit` requests in flight."""

    limit: int


class Hold(Protocol):
    """What one admission took: settle() corrects its tokens to the real count and gives its
    slot back; release() gives the slot back alone (a request dropped unsettled). Both act
    once, whichever comes first."""

    def settle(self, tokens: int) -> None: ...

    def release(self) -> None: ...


Admitted = Hold | Refusal | InFlightRefusal


class KeyLimits(Protocol):
    async def admit(
        self,
        key: KeyRecord,
        requests: int,
        tokens: int,
        slot: bool,
        most_tokens: int | None = None,
    ) -> Admitted:
        """Charges `requests` and `tokens` to the key and, if `slot`, takes one of its
        concurrency slots; or refuses and charges nothing. `most_tokens` (prompt + max_tokens)
        is the most the request can take: it must fit beside what the key's unsettled requests
        may still take, within the overshoot allowed (gateway/tenancy/limiter.py)."""
        ...

    async def take_slot(self, key: KeyRecord) -> Hold | InFlightRefusal:
        """One of the key's concurrency slots alone (work charged already: a batch item), or
        the refusal of a key at its cap; a key without a cap holds nothing."""
        ...

    def forget(self, key_id: int) -> None:
        """Drops what is kept for a revoked key."""
        ...


class NoHold:
    """The hold of a key with no limit to count against."""

    def settle(self, tokens: int) -> None:
        pass

    def release(self) -> None:
        pass


NO_HOLD = NoHold()


def unlimited(key: KeyRecord, slot: bool) -> bool:
    limits = key.limits
    return (
        limits.requests_per_minute is None
        and limits.tokens_per_minute is None
        and not (slot and key.max_concurrent_requests is not None)
    )


def never_fits(limits: Limits, requests: int, tokens: int) -> Refusal | None:
    """A charge larger than a whole minute's limit: refused whatever was used (no Retry-After)."""
    checks: tuple[tuple[LimitKind, int | None, int], ...] = (
        ("requests", limits.requests_per_minute, requests),
        ("tokens", limits.tokens_per_minute, tokens),
    )
    for kind, limit, wanted in checks:
        if limit is not None and wanted > limit:
            return Refusal(kind, limit, 0, wanted, None)
    return None


@dataclass(slots=True)
class SlotHold:
    """A concurrency slot taken alone (LocalKeyLimits.take_slot)."""

    slot: Slot

    def settle(self, tokens: int) -> None:
        self.slot.release()

    def release(self) -> None:
        self.slot.release()


@dataclass(slots=True)
class LocalHold:
    limiter: SlidingWindowLimiter
    charge: Charge
    slot: Slot | None

    def settle(self, tokens: int) -> None:
        self.release()
        self.limiter.settle(self.charge, tokens)

    def release(self) -> None:
        if self.slot is not None:
            self.slot.release()


class LocalKeyLimits:
    """Limits counted in this process: exact sliding windows and in-flight counts."""

    def __init__(
        self, limiter: SlidingWindowLimiter | None = None, in_flight: InFlightCounter | None = None
    ) -> None:
        self.limiter = limiter or SlidingWindowLimiter()
        self.in_flight = in_flight or InFlightCounter()

    async def admit(
        self,
        key: KeyRecord,
        requests: int,
        tokens: int,
        slot: bool,
        most_tokens: int | None = None,
    ) -> Admitted:
        taken: Slot | None = None
        if slot:
            cap = key.max_concurrent_requests
            if not self.in_flight.try_enter(key.id, cap):
                return InFlightRefusal(cap or 0)
            taken = Slot(self.in_flight, key.id)
        outcome = self.limiter.admit(key.id, key.limits, requests, tokens, most_tokens)
        if isinstance(outcome, Refusal):
            if taken is not None:
                taken.release()
            return outcome
        return LocalHold(self.limiter, outcome, taken)

    async def take_slot(self, key: KeyRecord) -> Hold | InFlightRefusal:
        cap = key.max_concurrent_requests
        if cap is None:
            return NO_HOLD
        if not self.in_flight.try_enter(key.id, cap):
            return InFlightRefusal(cap)
        return SlotHold(Slot(self.in_flight, key.id))

    def forget(self, key_id: int) -> None:
        self.limiter.forget(key_id)
