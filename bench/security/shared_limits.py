"""What sharing a key's limits through PostgreSQL adds to a request (issue 20, finding 12).

One admission as the request path makes it (requests, tokens and a concurrency slot, then the
settlement, which is queued) for a key with all three limits, against:
- in-process: LocalKeyLimits, the SQLite deployment's exact window (the baseline);
- shared: SharedKeyLimits on its counter pool (no pre-ping, synchronous_commit off), as shipped;
- shared, main pool: the same statement on the main engine (ping before each checkout, commit
  waiting for the WAL flush), the alternative not taken;
- floor: `SELECT 1` on the counter pool, one round trip and nothing else.
Sequential admissions run interleaved in rounds so that every variant sees the same machine;
then 16 concurrent clients on one hot key (its row lock serializes them) and on 16 keys.
The settlement writer runs alongside, as in a gateway. PostgreSQL: BENCH_DATABASE_URL's server
or 127.0.0.1:5432 (a fresh database, dropped after).

`python -m bench.security.shared_limits`
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime

import psycopg
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from bench.common import markdown_table, results_dir, write_results
from gateway.db.migrate import upgrade
from gateway.db.session import create_counter_engine, create_engine
from gateway.stores.key_limit_store import KeyLimitStore
from gateway.tenancy.key_limits import InFlightRefusal, KeyLimits, LocalKeyLimits
from gateway.tenancy.keys import KeyRecord
from gateway.tenancy.limiter import Refusal
from gateway.tenancy.shared_limits import SharedKeyLimits

SERVER = os.environ.get("BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
ROUNDS, PER_ROUND = 12, 40
CONCURRENT, PER_CLIENT = 16, 40
Admission = Callable[[], Awaitable[None]]


def _key(key_id: int) -> KeyRecord:
    return KeyRecord(
        key_id, f"bench-{key_id}", "fk-bench", 10**6, 10**9, datetime.now(UTC), None, 10**5
    )


def admission(limits: KeyLimits, key: KeyRecord) -> Admission:
    async def admit() -> None:
        held = await limits.admit(key, 1, 100, slot=True)
        if isinstance(held, Refusal | InFlightRefusal):
            raise RuntimeError(f"the bench's key was refused: {held}")
        held.settle(80)

    return admit


@contextlib.asynccontextmanager
async def fresh_database() -> AsyncIterator[str]:
    name = f"bench_limits_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(SERVER, autocommit=True) as connection:
        connection.execute(f'CREATE DATABASE "{name}"')
    url = SERVER.replace("postgresql://", "postgresql+psycopg://", 1).rsplit("/", 1)[0]
    try:
        yield f"{url}/{name}"
    finally:
        with psycopg.connect(SERVER, autocommit=True) as connection:
            connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def _make_keys(engine: AsyncEngine, count: int) -> None:
    async with engine.begin() as connection:
        for key_id in range(1, count + 1):
            await connection.execute(
                text(
                    "INSERT INTO api_keys (id, name, prefix, key_hash, created_at) "
                    "VALUES (:id, :name, 'fk-bench', :hash, now())"
                ),
                {"id": key_id, "name": f"bench-{key_id}", "hash": uuid.uuid4().hex * 2},
            )


def _stats(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {
        "median_ms": statistics.median(ordered) * 1000,
        "p90_ms": ordered[int(len(ordered) * 0.9)] * 1000,
        "p99_ms": ordered[int(len(ordered) * 0.99)] * 1000,
    }


async def _timed(admit: Admission, times: int) -> list[float]:
    seconds = []
    for _ in range(times):
        started = time.perf_counter()
        await admit()
        seconds.append(time.perf_counter() - started)
    return seconds


async def sequential(variants: dict[str, Admission]) -> dict[str, list[float]]:
    for admit in variants.values():
        await _timed(admit, 20)  # warm: connections, prepared statements
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(ROUNDS):
        for name, admit in variants.items():
            seconds[name] += await _timed(admit, PER_ROUND)
    return seconds


async def concurrent(admits: list[Admission]) -> tuple[list[float], float]:
    started = time.perf_counter()
    runs = await asyncio.gather(*(_timed(admit, PER_CLIENT) for admit in admits))
    wall = time.perf_counter() - started
    return [s for run in runs for s in run], CONCURRENT * PER_CLIENT / wall


Stats = dict[str, dict[str, float]]


async def measure(url: str) -> tuple[Stats, Stats]:
    upgrade(url)
    main_engine, counter_engine = create_engine(url), create_counter_engine(url)
    await _make_keys(main_engine, CONCURRENT + 2)
    shared = SharedKeyLimits(KeyLimitStore(counter_engine, uuid.uuid4().hex))
    main_autocommit = main_engine.execution_options(isolation_level="AUTOCOMMIT")
    on_main = SharedKeyLimits(KeyLimitStore(main_autocommit, uuid.uuid4().hex))
    writers = [asyncio.create_task(limits.run()) for limits in (shared, on_main)]

    async def floor() -> None:
        async with counter_engine.connect() as connection:
            await connection.execute(text("SELECT 1"))

    try:
        seconds = await sequential(
            {
                "in-process (SQLite deployment)": admission(LocalKeyLimits(), _key(1)),
                "shared, counter pool (shipped)": admission(shared, _key(1)),
                "shared, main pool (ping + durable commit)": admission(on_main, _key(2)),
                "floor: SELECT 1 round trip": floor,
            }
        )
        hot, hot_rate = await concurrent([admission(shared, _key(1))] * CONCURRENT)
        spread, spread_rate = await concurrent(
            [admission(shared, _key(3 + n)) for n in range(CONCURRENT)]
        )
    finally:
        for writer in writers:
            writer.cancel()
        await shared.close()
        await on_main.close()  # disposes the main engine's pool too
    return {name: _stats(s) for name, s in seconds.items()}, {
        f"{CONCURRENT} clients, one key": {**_stats(hot), "admissions_per_s": hot_rate},
        f"{CONCURRENT} clients, {CONCURRENT} keys": {
            **_stats(spread),
            "admissions_per_s": spread_rate,
        },
    }


def main() -> None:
    async def run() -> tuple[Stats, Stats]:
        async with fresh_database() as url:
            return await measure(url)

    load_before = os.getloadavg()[0]
    sequential_stats, concurrent_stats = asyncio.run(run())
    # Shared CPUs: the machine's load says how much of a millisecond is queueing for a core.
    load = f"1-minute load average: {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    base = sequential_stats["in-process (SQLite deployment)"]["median_ms"]
    rows: list[list[object]] = [
        [name, s["median_ms"], s["p90_ms"], s["p99_ms"], s["median_ms"] - base, ""]
        for name, s in sequential_stats.items()
    ]
    rows += [
        [name, s["median_ms"], s["p90_ms"], s["p99_ms"], s["median_ms"] - base,
         s["admissions_per_s"]]
        for name, s in concurrent_stats.items()
    ]  # fmt: skip
    table = markdown_table(
        ["admission (+ queued settlement)", "median ms", "p90 ms", "p99 ms",
         "added vs in-process ms", "admissions/s"],
        rows,
    )  # fmt: skip
    print(table)
    print(load)
    write_results(
        "shared_limits",
        {"sequential": sequential_stats, "concurrent": concurrent_stats, "load": load},
        f"{table}\n\n{load}",
        "python -m bench.security.shared_limits",
        results_dir("security"),
    )


if __name__ == "__main__":
    main()
