"""A key's limits held across every gateway of a deployment, through its PostgreSQL database.

The request path pays one statement, and only for a key that has limits: admission is an
atomic upsert of the key's counters per second over the last minute (gateway/stores/
key_limit_store.py, gateway/tenancy/second_windows.py) that checks requests, tokens and the
concurrency cap on the locked row. What follows a request is written behind it: settlements
(the real tokens replacing the prediction) and given-back concurrency slots are kept per key in
memory and written by one background task as soon as it can, many at a time under load.
Pending work is bounded by the number of keys, not of requests: corrections of one key and
second add up in one entry, and corrections of seconds that no longer count fold into one per
key. While the database refuses them they are retried, and the backlog shows
in /metrics (fedllm_gateway_shared_limits_pending).

A gateway's slots are "holds" renewed every RENEW_S; when a gateway stops renewing (it
crashed), the others hand its slots back after LEASE_S, so a dead replica cannot keep a key at
its cap. The same holds carry the margins of its unsettled requests (what each may still take
beyond its charge: gateway/tenancy/limiter.py), checked beside the minute's tokens against the
overshoot allowed. Counting windows use the gateways' wall clocks (kept in step by NTP); a
gateway whose clock lags sees the counts as they are rather than rolling them back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.exc import SQLAlchemyError

from gateway.stores.key_limit_store import Admit, KeyLimitStore, Settlement
from gateway.tenancy.key_limits import (
    NO_HOLD,
    Admitted,
    InFlightRefusal,
    NoHold,
    never_fits,
    unlimited,
)
from gateway.tenancy.keys import KeyRecord
from gateway.tenancy.limiter import DEFAULT_OVERSHOOT, LimitKind, Refusal
from gateway.tenancy.second_windows import (
    BUCKETS,
    SecondCounts,
    bucket_at,
    most_refusal,
    refusal,
)

log = logging.getLogger(__name__)
RENEW_S = 5.0
LEASE_S = 30.0
# Back-off between failed writes of the backlog.
_RETRY_FIRST_S = 0.1
_RETRY_MOST_S = 5.0
# Settlements of seconds no longer counted count only as overruns, all in this one.
_LONG_AGO = 0


@dataclass(slots=True)
class SharedHold:
    limits: SharedKeyLimits
    key_id: int
    # The Unix second it was charged in.
    bucket: int
    tokens: int
    # Whether the tokens are counted (the key has a tokens limit) and whether a slot is held.
    counted: bool
    slot: bool
    # What the request may still take beyond its charge, held until it is settled.
    margin: int = 0

    def settle(self, tokens: int) -> None:
        if self.counted and tokens != self.tokens:
            self.limits.queue_settlement(self.key_id, self.bucket, tokens - self.tokens)
            self.tokens = tokens
        self.counted = False
        self.release()

    def release(self) -> None:
        if self.slot or self.margin:
            self.limits.queue_release(self.key_id, int(self.slot), self.margin)
            self.slot, self.margin = False, 0


class SharedKeyLimits:
    def __init__(
        self,
        store: KeyLimitStore,
        clock: Callable[[], float] = time.time,
        overshoot: float = DEFAULT_OVERSHOOT,
    ) -> None:
        self._store = store
        self._clock = clock
        self._overshoot = overshoot
        self._settlements: Counter[tuple[int, int]] = Counter()
        self._releases: Counter[int] = Counter()
        self._margins: Counter[int] = Counter()
        self._wake = asyncio.Event()
        self.write_failures = 0

    @property
    def pending(self) -> int:
        """Settlements, slot releases and keys' margins not yet written."""
        return len(self._settlements) + sum(self._releases.values()) + len(+self._margins)

    def _tokens_most(self, key: KeyRecord) -> int | None:
        tpm = key.limits.tokens_per_minute
        return None if tpm is None else math.floor(self._overshoot * tpm)

    async def admit(
        self,
        key: KeyRecord,
        requests: int,
        tokens: int,
        slot: bool,
        most_tokens: int | None = None,
    ) -> Admitted:
        slot = slot and key.max_concurrent_requests is not None
        if unlimited(key, slot):
            return NO_HOLD
        too_big = never_fits(key.limits, requests, tokens)
        if too_big is not None:
            return too_big
        why: Refusal | InFlightRefusal | None = None
        for _ in range(2):  # a refusal nothing explains raced a settlement: one more try
            now = self._clock()
            admit = Admit(
                key_id=key.id,
                requests_per_minute=key.limits.requests_per_minute,
                tokens_per_minute=key.limits.tokens_per_minute,
                max_in_flight=key.max_concurrent_requests if slot else None,
                bucket=bucket_at(now),
                requests=requests,
                tokens=tokens,
                slot=slot,
                most=most_tokens,
                tokens_most=self._tokens_most(key),
            )
            if await self._store.admit(admit):
                counted = key.limits.tokens_per_minute is not None
                return SharedHold(self, key.id, admit.bucket, tokens, counted, slot, admit.margin)
            why = await self._explain(key, now, requests, tokens, slot, most_tokens)
            if self._releases[key.id] or self._margins[key.id]:
                # Slots and margins this gateway's finished requests gave back are still on
                # their way (written behind the request path): written now, then one more try.
                await self.write()
                continue
            if why is not None:
                return why
        if why is not None:
            return why
        # Still unexplained: the counters keep moving under it; the client retries shortly.
        limits = key.limits
        if limits.tokens_per_minute is not None:
            return Refusal("tokens", limits.tokens_per_minute, 0, tokens, 1.0)
        if limits.requests_per_minute is not None:
            return Refusal("requests", limits.requests_per_minute, 0, requests, 1.0)
        return InFlightRefusal(key.max_concurrent_requests or 0)

    async def take_slot(self, key: KeyRecord) -> SharedHold | NoHold | InFlightRefusal:
        cap = key.max_concurrent_requests
        if cap is None:
            return NO_HOLD
        for _ in range(2):
            # No requests or tokens and no limit but the cap: only the slot is checked and taken.
            slot_only = Admit(key.id, None, None, cap, bucket_at(self._clock()), 0, 0, True)
            if await self._store.admit(slot_only):
                return SharedHold(self, key.id, slot_only.bucket, 0, counted=False, slot=True)
            if not self._releases[key.id]:
                break
            await self.write()  # this gateway's given-back slots first, then once more
        return InFlightRefusal(cap)

    async def _explain(
        self,
        key: KeyRecord,
        now: float,
        requests: int,
        tokens: int,
        slot: bool,
        most_tokens: int | None = None,
    ) -> Refusal | InFlightRefusal | None:
        """Which limit refused the request, read back from the counters."""
        row = await self._store.read(key.id)
        if row is None:
            return None
        cap = key.max_concurrent_requests
        if slot and cap is not None and row.in_flight + 1 > cap:
            return InFlightRefusal(cap)
        counts = SecondCounts.of(row)
        checks: tuple[tuple[LimitKind, int | None, int], ...] = (
            ("requests", key.limits.requests_per_minute, requests),
            ("tokens", key.limits.tokens_per_minute, tokens),
        )
        found = [
            refused
            for kind, limit, wanted in checks
            if limit is not None
            and (refused := refusal(counts, now, kind, limit, wanted)) is not None
        ]
        tokens_most, tpm = self._tokens_most(key), key.limits.tokens_per_minute
        if tpm is not None and tokens_most is not None and most_tokens is not None:
            refused = most_refusal(counts, now, row.margin, tokens_most, tpm, most_tokens)
            if refused is not None:
                found.append(refused)
        # The binding limit is the one that frees last (or never).
        return max(found, key=_wait) if found else None

    def queue_settlement(self, key_id: int, bucket: int, delta: int) -> None:
        self._settlements[(key_id, bucket)] += delta
        self._wake.set()

    def queue_release(self, key_id: int, slots: int = 1, margin: int = 0) -> None:
        self._releases[key_id] += slots
        self._margins[key_id] += margin
        self._wake.set()

    def forget(self, key_id: int) -> None:
        pass  # a revoked key is refused before its limits are asked; its counters may stay

    async def write(self) -> bool:
        """Writes what is pending; False (and it stays pending) if the database refused."""
        settlements, self._settlements = self._settlements, Counter()
        releases, self._releases = self._releases, Counter()
        margins, self._margins = self._margins, Counter()
        if not settlements and not +releases and not +margins:
            return True
        bucket = bucket_at(self._clock())
        given_back = {key: (releases[key], margins[key]) for key in {*+releases, *+margins}}
        try:
            await self._store.write(
                bucket,
                [Settlement(key, charged, delta) for (key, charged), delta in settlements.items()],
                given_back,
            )
        except (SQLAlchemyError, OSError) as exc:
            self.write_failures += 1
            if self.write_failures == 1 or self.write_failures % 100 == 0:
                log.warning(
                    "writing shared limits failed (%s); %d keys' settlements and %d slots kept "
                    "to retry",
                    type(exc).__name__,
                    len(settlements),
                    sum(releases.values()),
                )
            self._settlements.update(_fold_old(settlements, bucket))
            self._releases.update(releases)
            self._margins.update(margins)
            return False
        return True

    async def run(self) -> None:
        """Writes the backlog as it comes, renews this gateway's holds and hands back those of
        gateways gone silent; runs until cancelled."""
        renew_at = 0.0
        delay = _RETRY_FIRST_S
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._wake.wait(), timeout=max(renew_at - time.monotonic(), 0.0)
                )
            self._wake.clear()
            if await self.write():
                delay = _RETRY_FIRST_S
            else:
                self._wake.set()  # try again after the back-off
                await asyncio.sleep(delay)
                delay = min(delay * 2, _RETRY_MOST_S)
            if time.monotonic() >= renew_at:
                renew_at = time.monotonic() + RENEW_S
                try:
                    reaped = await self._store.renew(LEASE_S)
                except (SQLAlchemyError, OSError) as exc:
                    log.warning("renewing this gateway's key slots failed: %s", type(exc).__name__)
                    continue
                if reaped:
                    log.info("handed back the slots of a silent gateway on %d keys", reaped)

    async def close(self, attempts: int = 3) -> None:
        """Writes what is left at shutdown (what the database still refuses is logged; the
        slots come back to the others once this gateway's holds lapse), then closes the store."""
        try:
            for _ in range(attempts):
                if await self.write():
                    return
                await asyncio.sleep(_RETRY_FIRST_S)
            log.error(
                "shutting down with %d shared-limit settlements and %d slots unwritten",
                len(self._settlements),
                sum(self._releases.values()),
            )
        finally:
            await self._store.dispose()


def _wait(refused: Refusal) -> float:
    return math.inf if refused.retry_after_s is None else refused.retry_after_s


def _fold_old(settlements: Counter[tuple[int, int]], bucket: int) -> Counter[tuple[int, int]]:
    """Keeps pending settlements bounded while the database is away: corrections of seconds
    no longer counted only matter as overruns, so each key keeps one entry for them."""
    kept: Counter[tuple[int, int]] = Counter()
    for (key, charged), delta in settlements.items():
        if charged > bucket - BUCKETS:
            kept[(key, charged)] += delta
        elif delta > 0:
            kept[(key, _LONG_AGO)] += delta
    return kept
