"""Per-key limits shared through PostgreSQL (gateway/tenancy/shared_limits.py and its SQL in
gateway/stores/key_limit_store.py), with two SharedKeyLimits on one database standing for two
gateways: the SQL decides as the Python arithmetic of second_windows.py does, requests, tokens
and the concurrency cap hold over both together (also under a race) and in any 60 s (across a
minute boundary too), settlements correct the right second, a silent gateway's slots come back,
and writes the database refuses are kept and written once it takes them again."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.db.migrate import downgrade, upgrade
from gateway.db.session import create_counter_engine, create_engine, create_sessionmaker
from gateway.stores.key_limit_store import Admit, KeyLimitStore, Settlement
from gateway.tenancy.key_limits import InFlightRefusal
from gateway.tenancy.keys import KeyService
from gateway.tenancy.limiter import Refusal
from gateway.tenancy.second_windows import BUCKETS, SecondCounts, refusal
from gateway.tenancy.shared_limits import SharedHold, SharedKeyLimits
from tests.support.greedy_client import Clock as GreedyClock
from tests.support.greedy_client import greedy, most_in_any_window

pytestmark = pytest.mark.postgres
MINUTE = 29_000_000  # some minute of 2025
T = MINUTE * 60


class Clock:
    def __init__(self, seconds: float) -> None:
        self.now = seconds

    def __call__(self) -> float:
        return self.now


@asynccontextmanager
async def database(url: str) -> AsyncIterator[tuple[AsyncEngine, KeyService]]:
    upgrade(url)
    engine = create_counter_engine(url)
    main = create_engine(url)
    try:
        yield engine, KeyService(create_sessionmaker(main))
    finally:
        await engine.dispose()
        await main.dispose()
        downgrade(url)


def gateways(
    engine: AsyncEngine, clock: Callable[[], float]
) -> tuple[SharedKeyLimits, SharedKeyLimits]:
    return (
        SharedKeyLimits(KeyLimitStore(engine, "a" * 32), clock),
        SharedKeyLimits(KeyLimitStore(engine, "b" * 32), clock),
    )


async def _set_row(engine: AsyncEngine, key_id: int, counts: SecondCounts) -> None:
    async with engine.begin() as connection:
        await connection.execute(
            text(
                "INSERT INTO key_limit_windows "
                "(api_key_id, bucket, second_requests, second_tokens, in_flight) "
                "VALUES (:k, :b, :r, :t, 0) ON CONFLICT (api_key_id) DO UPDATE "
                "SET bucket = :b, second_requests = :r, second_tokens = :t, in_flight = 0"
            ),
            {"k": key_id, "b": counts.bucket, "r": list(counts.requests), "t": list(counts.tokens)},
        )


def seconds(bucket: int, by_age: dict[int, tuple[int, int]]) -> SecondCounts:
    """Counts ending in second `bucket`: {age in seconds: (requests, tokens)}."""
    requests, tokens = [0] * BUCKETS, [0] * BUCKETS
    for age, (r, t) in by_age.items():
        requests[BUCKETS - 1 - age], tokens[BUCKETS - 1 - age] = r, t
    return SecondCounts(bucket, tuple(requests), tuple(tokens))


# (stored counts, the admitting gateway's clock, requests, tokens) under 10 rpm / 1000 tpm.
AGREEMENT = [
    (seconds(T, {0: (5, 500)}), T + 0.5, 1, 100),
    (seconds(T, {30: (9, 100)}), T + 0.5, 2, 10),  # requests over
    (seconds(T, {59: (1, 100), 2: (1, 900)}), T + 0.1, 1, 100),  # tokens over
    (seconds(T, {60: (1, 100), 2: (1, 900)}), T + 1.1, 1, 100),  # the oldest left: fits
    (seconds(T, {60: (9, 900), 0: (1, 100)}), T + 0.99, 1, 1),  # still counted: over
    (seconds(T - 30, {30: (10, 1000)}), T + 0.5, 1, 1),  # rolled: still counted, over
    (seconds(T - 30, {31: (10, 1000)}), T + 0.5, 10, 1000),  # rolled: gone
    (seconds(T - 5000, {0: (10, 1000)}), T, 10, 1000),  # long gone
    (seconds(T + 1, {0: (10, 0)}), T + 0.5, 1, 0),  # lagging clock: as stored, over
]


@pytest.mark.parametrize(("stored", "at", "requests", "tokens"), AGREEMENT)
def test_the_sql_decides_as_the_arithmetic(
    postgres_url: str, stored: SecondCounts, at: float, requests: int, tokens: int
) -> None:
    async def run() -> None:
        async with database(postgres_url) as (engine, keys):
            key = (await keys.create("k", 10, 1000)).record
            await _set_row(engine, key.id, stored)
            store = KeyLimitStore(engine, "a" * 32)
            bucket = math.floor(at)
            admitted = await store.admit(
                Admit(key.id, 10, 1000, None, bucket, requests, tokens, False)
            )
            expected = (
                refusal(stored, at, "requests", 10, requests) is None
                and refusal(stored, at, "tokens", 1000, tokens) is None
            )
            assert admitted == expected
            row = await store.read(key.id)
            assert row is not None
            # A refusal changes nothing.
            assert SecondCounts.of(row) == (
                stored.charged(bucket, requests, tokens) if admitted else stored
            )

    asyncio.run(run())


def test_settlements_correct_the_second_charged_as_the_arithmetic_does(postgres_url: str) -> None:
    stored = seconds(T, {40: (1, 100), 0: (1, 100)})
    # (the settling gateway's second, the second charged, delta)
    corrections = [(T + 5, T - 40, 30), (T + 5, T, -60), (T + 30, T - 40, 25), (T + 31, T, -999)]

    async def run() -> None:
        async with database(postgres_url) as (engine, keys):
            key = (await keys.create("k", 10, 1000)).record
            await _set_row(engine, key.id, stored)
            store = KeyLimitStore(engine, "a" * 32)
            expected = stored
            for bucket, charged, delta in corrections:
                await store.write(bucket, [Settlement(key.id, charged, delta)], {})
                expected = expected.settled(bucket, charged, delta)
                row = await store.read(key.id)
                assert row is not None
                assert SecondCounts.of(row) == expected
            # 100 + 30 left the window; its later overrun of 25 counts at T + 30; 100 - 60 - 999
            # is nothing.
            assert expected.used("tokens") == 25

    asyncio.run(run())


def test_requests_and_tokens_hold_over_two_gateways(postgres_url: str) -> None:
    async def run() -> None:
        async with database(postgres_url) as (engine, keys):
            key = (await keys.create("k", 3, 1000)).record
            clock = Clock(MINUTE * 60 + 30)
            first, second = gateways(engine, clock)
            outcomes = [
                await gateway.admit(key, 1, 100, slot=True)
                for gateway in (first, second, first, second)
            ]
            assert [isinstance(o, SharedHold) for o in outcomes] == [True, True, True, False]
            refused = outcomes[-1]
            assert isinstance(refused, Refusal)
            assert refused.kind == "requests"
            # The three of second :30 count until the window's newest second is a minute after
            # theirs: 61 s from now.
            assert refused.retry_after_s == pytest.approx(61, abs=0.01)
            # Settled to less than predicted: the difference is free again, on the other side.
            for hold in outcomes[:3]:
                assert isinstance(hold, SharedHold)
                hold.settle(40)
            assert first.pending
            assert second.pending
            assert await first.write()
            assert await second.write()
            row = await KeyLimitStore(engine, "c" * 32).read(key.id)
            assert row is not None
            counts = SecondCounts.of(row)
            assert (counts.used("requests"), counts.used("tokens")) == (3, 120)

    asyncio.run(run())


def test_an_overrun_settled_after_its_minute_counts_now(postgres_url: str) -> None:
    async def run() -> None:
        async with database(postgres_url) as (engine, keys):
            key = (await keys.create("k", None, 1000)).record
            clock = Clock(MINUTE * 60 + 59)
            first, _ = gateways(engine, clock)
            hold = await first.admit(key, 1, 30, slot=False)
            assert isinstance(hold, SharedHold)
            clock.now += 180  # the request ran three minutes
            hold.settle(930)
            assert await first.write()
            row = await KeyLimitStore(engine, "c" * 32).read(key.id)
            assert row is not None
            counts = SecondCounts.of(row)
            assert (counts.bucket, counts.used("tokens")) == (T + 239, 900)
            assert counts.tokens[-1] == 900  # the overrun counts now
            refused = await first.admit(key, 1, 200, slot=False)
            assert isinstance(refused, Refusal)
            assert refused.kind == "tokens"

    asyncio.run(run())


def test_the_concurrency_cap_holds_over_two_gateways_under_a_race(postgres_url: str) -> None:
    async def run() -> None:
        async with database(postgres_url) as (engine, keys):
            key = (await keys.create("k", None, None, max_concurrent_requests=3)).record
            first, second = gateways(engine, Clock(MINUTE * 60))
            outcomes = await asyncio.gather(
                *(gateway.admit(key, 1, 10, slot=True) for gateway in (first, second) * 10)
            )
            holds = [o for o in outcomes if isinstance(o, SharedHold)]
            assert len(holds) == 3
            assert all(isinstance(o, InFlightRefusal) and o.limit == 3 for o in outcomes
                       if not isinstance(o, SharedHold))  # fmt: skip
            holds[0].settle(10)
            holds[0].release()  # once only, whichever comes first
            assert await holds[0].limits.write()
            again = await second.admit(key, 1, 10, slot=True)
            assert isinstance(again, SharedHold)
            assert isinstance(await first.admit(key, 1, 10, slot=True), InFlightRefusal)

    asyncio.run(run())


def test_under_predicted_requests_cannot_run_a_key_past_the_overshoot(postgres_url: str) -> None:
    """Issue 32's probe on the shared counters: 700 tokens/min, requests charged 142 that may
    take 420; over two gateways, what is admitted stays within 1.2x the limit until the
    requests end and give their margins back."""

    async def run() -> None:
        async with database(postgres_url) as (engine, keys):
            key = (await keys.create("k", None, 700)).record
            clock = Clock(MINUTE * 60 + 1)
            first, second = (
                SharedKeyLimits(KeyLimitStore(engine, name * 32), clock, overshoot=1.2)
                for name in "ab"
            )
            held = []
            for gateway in (first, second):
                hold = await gateway.admit(key, 1, 142, False, 420)
                assert isinstance(hold, SharedHold)
                held.append(hold)
            refused = await first.admit(key, 1, 142, False, 420)
            assert isinstance(refused, Refusal)
            assert (refused.kind, refused.requested, refused.retry_after_s) == ("tokens", 420, 1.0)
            row = await first._store.read(key.id)
            assert row is not None
            assert (SecondCounts.of(row).used("tokens"), row.margin) == (284, 556)
            held[0].settle(150)  # it ended early: its margin back, its tokens corrected
            assert await first.write()
            row = await first._store.read(key.id)
            assert row is not None
            assert (SecondCounts.of(row).used("tokens"), row.margin) == (292, 278)
            # 292 taken + 278 the other may still take + 420: more than 840.
            assert isinstance(await second.admit(key, 1, 142, False, 420), Refusal)
            held[1].settle(150)
            assert isinstance(await second.admit(key, 1, 142, False, 420), SharedHold)

    asyncio.run(run())


def test_a_slot_alone_shares_the_cap_and_charges_nothing(postgres_url: str) -> None:
    """What a batch item takes (its requests and tokens were charged at submission): a slot
    under the cap, whatever the key's minute holds, and nothing else."""

    async def run() -> None:
        async with database(postgres_url) as (engine, keys):
            key = (await keys.create("k", 1, 100, max_concurrent_requests=2)).record
            first, second = gateways(engine, Clock(MINUTE * 60))
            request = await first.admit(key, 1, 100, slot=True)  # the minute's whole budget
            assert isinstance(request, SharedHold)
            item = await second.take_slot(key)  # the cap's second slot: still free
            assert isinstance(item, SharedHold)
            assert await first.take_slot(key) == InFlightRefusal(2)
            item.release()
            assert await second.write()
            again = await first.take_slot(key)
            assert isinstance(again, SharedHold)
            row = await first._store.read(key.id)
            assert row is not None
            counts = SecondCounts.of(row)
            assert (counts.used("requests"), counts.used("tokens"), row.in_flight) == (1, 100, 2)
            uncapped = (await keys.create("u", 1, 100)).record
            assert not isinstance(await first.take_slot(uncapped), (SharedHold, InFlightRefusal))

    asyncio.run(run())


def test_a_gateways_own_slots_given_back_count_before_it_refuses(postgres_url: str) -> None:
    async def run() -> None:
        async with database(postgres_url) as (engine, keys):
            key = (await keys.create("k", None, None, max_concurrent_requests=1)).record
            first, _ = gateways(engine, Clock(MINUTE * 60))
            for _ in range(3):  # one after the other: each gives its slot back as it ends
                hold = await first.admit(key, 1, 10, slot=True)
                assert isinstance(hold, SharedHold)
                hold.settle(10)
                assert first.pending == 1  # written behind the request path ...
            # ... or before a refusal it would explain.
            assert first.pending == 1

    asyncio.run(run())


def test_a_silent_gateways_slots_come_back(postgres_url: str) -> None:
    async def run() -> None:
        async with database(postgres_url) as (engine, keys):
            key = (await keys.create("k", None, None, max_concurrent_requests=1)).record
            first, second = gateways(engine, Clock(MINUTE * 60))
            assert isinstance(await first.admit(key, 1, 10, slot=True), SharedHold)
            assert isinstance(await second.admit(key, 1, 10, slot=True), InFlightRefusal)
            # The first gateway dies holding its slot: it renews nothing from now on.
            async with engine.begin() as connection:
                await connection.execute(
                    text("UPDATE key_in_flight_holds SET renewed_at = now() - interval '31 s'")
                )
            reaped = await KeyLimitStore(engine, "b" * 32).renew(lease_s=30)
            assert reaped == 1
            assert isinstance(await second.admit(key, 1, 10, slot=True), SharedHold)

    asyncio.run(run())


REFUSE_UPDATES = (
    # The slots given back are refused, after the settlements of the same write went through:
    # the write must then apply none of them (they are all kept, and written again).
    # OR REPLACE, and dropped below: the session's database is shared, and another module makes
    # a function of the same name (in whichever order the workers run them).
    """CREATE OR REPLACE FUNCTION refuse_writes() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
      RAISE EXCEPTION 'terminating connection due to administrator command'
        USING ERRCODE = '57P01';
    END $$""",
    """CREATE TRIGGER refuse_writes BEFORE UPDATE ON key_in_flight_holds
      FOR EACH ROW EXECUTE FUNCTION refuse_writes()""",
)


def test_writes_the_database_refuses_are_kept_until_it_takes_them(postgres_url: str) -> None:
    async def run() -> None:
        async with database(postgres_url) as (engine, keys):
            other = (await keys.create("other", None, 1000)).record
            key = (await keys.create("k", None, 1000, max_concurrent_requests=5)).record
            clock = Clock(MINUTE * 60)
            first, _ = gateways(engine, clock)
            holds = []
            for minute in range(MINUTE, MINUTE + 4):  # one request admitted in each minute
                clock.now = minute * 60
                holds.append(await first.admit(key, 1, 100, slot=True))
            others = await first.admit(other, 1, 100, slot=False)
            async with engine.begin() as connection:
                for statement in REFUSE_UPDATES:
                    await connection.execute(text(statement))
            assert isinstance(others, SharedHold)
            others.settle(110)
            for hold in holds:
                assert isinstance(hold, SharedHold)
                hold.settle(150)  # each ran 50 tokens over
            assert first.pending == 1 + 4 + 4
            assert not await first.write()
            assert first.write_failures == 1
            # Corrections of seconds no longer counted fold into one entry per key.
            assert first.pending == 1 + 3 + 4
            async with engine.begin() as connection:
                await connection.execute(text("DROP TRIGGER refuse_writes ON key_in_flight_holds"))
                await connection.execute(text("DROP FUNCTION refuse_writes()"))
            assert await first.write()
            assert first.pending == 0
            row = await KeyLimitStore(engine, "c" * 32).read(key.id)
            assert row is not None
            assert row.in_flight == 0
            # This second: its own 100 + 50, and the 2 x 50 of seconds no longer counted; a
            # minute ago (still counted): its 100 + 50.
            counts = SecondCounts.of(row)
            assert counts.bucket == T + 180
            assert (counts.tokens[0], counts.tokens[-1], counts.used("tokens")) == (150, 250, 400)
            # Counted once, though written twice.
            others_row = await KeyLimitStore(engine, "c" * 32).read(other.id)
            assert others_row is not None
            others_counts = SecondCounts.of(others_row)
            assert (others_counts.bucket, others_counts.used("tokens")) == (T + 180, 110)

    asyncio.run(run())


# (requests per minute, tokens per minute, charged, most, taken, the bound in any 60 s)
BOUNDARY = {
    "tokens": (None, 700, 100, 100, 100, 700),
    "requests": (7, None, 1, 1, 1, 7),
    # Issue 32's probe: charged 142 as predicted, generating 400 of max_tokens 420; the bound
    # is GATEWAY_TOKEN_LIMIT_OVERSHOOT (1.2) x the limit.
    "under-predicted": (None, 700, 142, 420, 400, 840),
}


@pytest.mark.parametrize("case", list(BOUNDARY))
def test_no_60_s_admits_more_than_the_limit_across_a_minute_boundary(
    postgres_url: str, case: str
) -> None:
    """Issue 48, finding 2: a client asking again at each Retry-After, from the last second of a
    minute on, over two gateways. Counted in clock minutes (the previous one fading as the
    current one goes on), it was admitted its limit at 0:59 and most of it again before 1:59:
    1.86x in 60 s. Counted in one-second buckets, never more than the limit in any 60 s; and
    as often as the limit allows (a charge counts at most a second longer than a minute)."""
    rpm, tpm, charged, most, taken, bound = BOUNDARY[case]

    async def run() -> None:
        async with database(postgres_url) as (engine, keys):
            key = (await keys.create("k", rpm, tpm)).record
            clock = GreedyClock(MINUTE * 60 + 59)
            first, second = gateways(engine, clock)
            admitted = await greedy(first, key, clock, 30, charged, most, taken)
            assert await first.write()  # what the first settled, before the second asks
            admitted += await greedy(second, key, clock, 150, charged, most, taken)
            counted = [(at, 1 if rpm is not None else tokens) for at, tokens in admitted]
            assert most_in_any_window(counted) <= bound
            limit = rpm if rpm is not None else tpm
            assert limit is not None
            assert sum(n for _, n in counted) >= 2.5 * limit  # 0:59, ~2:00 and ~3:01

    asyncio.run(run())
