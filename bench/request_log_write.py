"""What one request-log transaction costs the gateway's process: the async session (how the log
was written before) against the transaction thread (gateway/db/transaction_thread.py).

    python -m bench.request_log_write [--postgres URL] [--transactions 300] [--rounds 4]

Each transaction writes a batch as the write-behind queue hands it over (request rows with their
outcomes, and their length samples) for batches of 1, 5 and 50 requests, on SQLite (a file) and,
with --postgres, on PostgreSQL. CPU is this process's (every thread: the aiosqlite thread and
the transaction thread included), per transaction; the two ways alternate in rounds so that a
change of the host's speed hits both. The process is pinned to one core, as the gateway is in
the overhead benchmark. Writes bench/results/gateway_overhead/request_log_write.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import cast

from sqlalchemy import Table, insert

from bench.common import markdown_table, results_dir, write_results
from gateway.db.migrate import upgrade
from gateway.db.models import InferenceRequest, LengthSample, RequestStatus, utcnow
from gateway.db.session import create_engine, create_sessionmaker
from gateway.stores import request_log as rl

BATCH_SIZES = (1, 5, 50)
_REQUESTS = cast(Table, InferenceRequest.__table__)
_SAMPLES = cast(Table, LengthSample.__table__)


def _batch(size: int) -> rl.LogBatch:
    batch = rl.LogBatch()
    for _ in range(size):
        request_id = uuid.uuid4().hex
        new = rl.NewRequest(
            request_id, "chat", "m", False, None, 12, 16, "mico", None, 40, 0, "v", 90
        )
        outcome = rl.Outcome(RequestStatus.COMPLETED, None, 1, 8, "stop")
        batch.inserts.append(rl.request_row(new, utcnow()) | rl.outcome_values(outcome, utcnow()))
        sample = rl.NewSample("m", "Say hello.", 12, 8, False, 40)
        batch.samples.append(rl.sample_row(request_id, sample, utcnow()))
    return batch


async def _cpu_ms(write: Callable[[rl.LogBatch], Awaitable[None]], size: int, count: int) -> float:
    batches = [_batch(size) for _ in range(count)]
    started = time.process_time()
    for batch in batches:
        await write(batch)
    return (time.process_time() - started) * 1000 / count


async def _measure(url: str, transactions: int, rounds: int) -> dict[str, dict[int, float]]:
    engine = create_engine(url)
    sessions = create_sessionmaker(engine)
    log = rl.RequestLog(sessions)

    async def async_session(batch: rl.LogBatch) -> None:
        async with sessions.begin() as session:
            await session.execute(insert(_REQUESTS), batch.inserts)
            await session.execute(insert(_SAMPLES), batch.samples)

    ways = {"async session": async_session, "transaction thread": log.write}
    samples: dict[str, dict[int, list[float]]] = {w: {s: [] for s in BATCH_SIZES} for w in ways}
    try:
        for way in ways.values():
            await _cpu_ms(way, 5, 20)  # connections opened, statements compiled
        for round_index in range(rounds):
            order = list(ways.items()) if round_index % 2 == 0 else list(ways.items())[::-1]
            for name, way in order:
                for size in BATCH_SIZES:
                    samples[name][size].append(await _cpu_ms(way, size, transactions))
    finally:
        await log.close()
        await engine.dispose()
    return {w: {s: statistics.median(v) for s, v in by.items()} for w, by in samples.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.request_log_write")
    parser.add_argument("--postgres", help="an empty PostgreSQL database (migrated here)")
    parser.add_argument("--transactions", type=int, default=300, help="per way, size and round")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)
    os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    with tempfile.TemporaryDirectory() as scratch:
        databases = {"SQLite": f"sqlite+aiosqlite:///{Path(scratch) / 'gateway.db'}"}
        if args.postgres:
            databases["PostgreSQL"] = args.postgres
        results = {}
        for name, url in databases.items():
            upgrade(url)
            results[name] = asyncio.run(_measure(url, args.transactions, args.rounds))
    rows = [
        [db, size, by_way["async session"][size], by_way["transaction thread"][size],
         by_way["transaction thread"][size] / by_way["async session"][size]]
        for db, by_way in results.items()
        for size in BATCH_SIZES
    ]  # fmt: skip
    table = markdown_table(
        ["database", "requests per transaction", "async session CPU ms", "thread CPU ms", "ratio"],
        rows,
    )
    text = (
        f"CPU of this process per transaction (medians of {args.rounds} rounds of "
        f"{args.transactions} transactions, the two ways alternating; one core).\n\n{table}\n"
    )
    command = "python -m bench.request_log_write " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    payload = {"cpu_ms_per_transaction": results}
    write_results("request_log_write", payload, text, command, results_dir("gateway_overhead"))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
