"""Per-key limits shared through PostgreSQL (gateway/tenancy/shared_limits.py and its SQL in
gateway/stores/key_limit_store.py), with two SharedKeyLimits on one database standing for two
gateways: the SQL decides as the Python arithmetic of minute_windows.py does, requests, tokens
and the concurrency cap hold over both together (also under a race), settlements correct the
right minute, a silent gateway's slots come back, and writes the database refuses are kept and
written once it takes them again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.db.migrate import downgrade, upgrade
from gateway.db.session import create_counter_engine, create_engine, create_sessionmaker
from gateway.stores.key_limit_store import Admit, KeyLimitStore
from gateway.tenancy.key_limits import InFlightRefusal
from gateway.tenancy.keys import KeyService
from gateway.tenancy.limiter import Refusal
from gateway.tenancy.minute_windows import MinuteClock, MinuteCounts, refusal
from gateway.tenancy.shared_limits import SharedHold, SharedKeyLimits

pytestmark = pytest.mark.postgres
MINUTE = 29_000_000  # some minute of 2025


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


async def _set_row(engine: AsyncEngine, key_id: int, counts: MinuteCounts) -> None:
    async with engine.begin() as connection:
        await connection.execute(
            text(
                "INSERT INTO key_limit_windows VALUES (:k, :m, :r, :t, :pr, :pt, 0) "
                "ON CONFLICT (api_key_id) DO UPDATE SET minute = :m, requests = :r, tokens = :t, "
                "previous_requests = :pr, previous_tokens = :pt, in_flight = 0"
            ),
            {
                "k": key_id,
                "m": counts.minute,
                "r": counts.requests,
                "t": counts.tokens,
                "pr": counts.previous_requests,
                "pt": counts.previous_tokens,
            },
        )


# (stored counts, the admitting gateway's clock, requests, tokens) under 10 rpm / 1000 tpm.
AGREEMENT = [
    (MinuteCounts(MINUTE, 5, 500, 0, 0), MinuteClock(MINUTE, 0.5), 1, 100),
    (MinuteCounts(MINUTE, 9, 100, 0, 0), MinuteClock(MINUTE, 0.5), 2, 10),  # requests over
    (MinuteCounts(MINUTE, 1, 100, 10, 900), MinuteClock(MINUTE, 0.1), 1, 100),  # tokens over
    (MinuteCounts(MINUTE, 1, 100, 10, 900), MinuteClock(MINUTE, 0.9), 1, 100),  # faded: fits
    (MinuteCounts(MINUTE - 1, 10, 1000, 0, 0), MinuteClock(MINUTE, 0.05), 1, 1),  # rolled: over
    (MinuteCounts(MINUTE - 1, 10, 1000, 0, 0), MinuteClock(MINUTE, 0.95), 1, 1),  # rolled: fits
    (MinuteCounts(MINUTE - 5, 10, 1000, 10, 1000), MinuteClock(MINUTE, 0.0), 10, 1000),  # gone
    (MinuteCounts(MINUTE + 1, 10, 0, 0, 0), MinuteClock(MINUTE, 0.5), 1, 0),  # lagging clock
]


@pytest.mark.parametrize(("stored", "clock", "requests", "tokens"), AGREEMENT)
def test_the_sql_decides_as_the_arithmetic(
    postgres_url: str, stored: MinuteCounts, clock: MinuteClock, requests: int, tokens: int
) -> None:
    async def run() -> None:
        async with database(postgres_url) as (engine, keys):
            key = (await keys.create("k", 10, 1000)).record
            await _set_row(engine, key.id, stored)
            store = KeyLimitStore(engine, "a" * 32)
            admitted = await store.admit(
                Admit(key.id, 10, 1000, None, clock.minute, clock.previous_weight,
                      requests, tokens, False)
            )  # fmt: skip
            expected = (
                refusal(stored, clock, "requests", 10, requests) is None
                and refusal(stored, clock, "tokens", 1000, tokens) is None
            )
            assert admitted == expected
            row = await store.read(key.id)
            assert row is not None
            rolled = stored.at(clock.minute)
            if admitted:
                rolled = MinuteCounts(
                    rolled.minute,
                    rolled.requests + requests,
                    rolled.tokens + tokens,
                    rolled.previous_requests,
                    rolled.previous_tokens,
                )
            else:
                rolled = stored  # a refusal changes nothing
            assert MinuteCounts(*[getattr(row, f) for f in MinuteCounts.__slots__]) == rolled

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
            # This minute's three count in full for its last 30 s, then fade: 3 * (1 - t/60)
            # leaves room for one more 20 s into the next minute.
            assert refused.retry_after_s == pytest.approx(50, abs=0.01)
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
            assert (row.requests, row.tokens) == (3, 120)

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
            assert (row.minute, row.tokens, row.previous_tokens) == (MINUTE + 3, 900, 0)
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
            assert (row.tokens, row.margin) == (284, 556)
            held[0].settle(150)  # it ended early: its margin back, its tokens corrected
            assert await first.write()
            row = await first._store.read(key.id)
            assert row is not None
            assert (row.tokens, row.margin) == (292, 278)
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
            assert (row.requests, row.tokens, row.in_flight) == (1, 100, 2)
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
            # Corrections of minutes before the previous one fold into one entry per key.
            assert first.pending == 1 + 3 + 4
            async with engine.begin() as connection:
                await connection.execute(text("DROP TRIGGER refuse_writes ON key_in_flight_holds"))
                await connection.execute(text("DROP FUNCTION refuse_writes()"))
            assert await first.write()
            assert first.pending == 0
            row = await KeyLimitStore(engine, "c" * 32).read(key.id)
            assert row is not None
            assert row.in_flight == 0
            # This minute: its own 100 + 50, and the 2 x 50 of minutes that no longer count;
            # the previous minute: its 100 + 50.
            assert (row.minute, row.tokens, row.previous_tokens) == (MINUTE + 3, 250, 150)
            # Counted once, though written twice.
            others_row = await KeyLimitStore(engine, "c" * 32).read(other.id)
            assert others_row is not None
            assert (others_row.minute, others_row.tokens) == (MINUTE + 3, 110)

    asyncio.run(run())
