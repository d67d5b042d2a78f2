"""Writes the request log refuses are kept and written once it takes them (PostgreSQL refusing
updates of `requests` through a trigger, as a restarting server does): nothing is given up while
the gateway runs, the queue is bounded (full at its capacity; the samples riding along are
dropped past their byte budget), and what is left at shutdown is logged request by request."""

from __future__ import annotations

import asyncio
import logging

import pytest
from sqlalchemy import select, text

from gateway.db.models import InferenceRequest, LengthSample, RequestStatus
from gateway.db.session import create_engine, create_sessionmaker
from gateway.stores.request_log import NewRequest, NewSample, Outcome, RequestLog
from gateway.stores.request_writer import RequestLogWriter
from tests.support.migrated import run_migrated

pytestmark = pytest.mark.postgres
REFUSE = (
    # OR REPLACE: the session's database is shared with other modules' refusing triggers.
    """CREATE OR REPLACE FUNCTION refuse_writes() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
      RAISE EXCEPTION 'terminating connection due to administrator command'
        USING ERRCODE = '57P01';
    END $$""",
    "CREATE TRIGGER refuse_writes BEFORE UPDATE ON requests "
    "FOR EACH ROW EXECUTE FUNCTION refuse_writes()",
)
ALLOW = ("DROP TRIGGER refuse_writes ON requests", "DROP FUNCTION refuse_writes()")


def _sample(prompt: str) -> NewSample:
    return NewSample("m", prompt, 3, 7, False, None)


async def _exercise(url: str, caplog: pytest.LogCaptureFixture) -> None:
    engine = create_engine(url)
    sessions = create_sessionmaker(engine)

    async def run(statements: tuple[str, ...]) -> None:
        async with engine.begin() as connection:
            for statement in statements:
                await connection.execute(text(statement))

    try:
        log = RequestLog(sessions)
        for request_id in ("r1", "r2", "r3", "r4"):
            await log.accepted(
                NewRequest(request_id, "completions", "m", False, None, 3, 16, "round_robin", None)
            )
        await run(REFUSE)
        backlog = RequestLogWriter(log, capacity=3, flush_s=0.01, sample_bytes=10)
        done = Outcome(RequestStatus.COMPLETED, None, 1, 7, "length")
        backlog.finished("r1", done, _sample("x" * 5))
        backlog.finished("r2", done, _sample("y" * 20))  # over the samples' budget: dropped
        backlog.finished("r3", done, None)
        assert backlog.full
        await asyncio.sleep(2.0)
        assert len(backlog) == 3
        assert backlog.failures >= 2
        assert backlog.oldest_s() >= 2.0
        await run(ALLOW)
        await backlog.drain(timeout_s=15)  # returns as soon as all is written
        assert len(backlog) == 0
        assert backlog.oldest_s() == 0.0
        async with sessions() as session:
            rows = dict(
                (await session.execute(select(InferenceRequest.id, InferenceRequest.status))).all()
            )
            samples = list(await session.scalars(select(LengthSample.request_id)))
        assert rows == {
            "r1": RequestStatus.COMPLETED,
            "r2": RequestStatus.COMPLETED,
            "r3": RequestStatus.COMPLETED,
            "r4": RequestStatus.DISPATCHED,
        }
        assert samples == ["r1"]
        # At shutdown, what the database still refuses is named in the log.
        await run(REFUSE)
        backlog.finished("r4", done, None)
        with caplog.at_level(logging.ERROR, logger="gateway.stores.request_writer"):
            await backlog.drain(timeout_s=0.5)
        assert "writes of r4 never made" in caplog.text
        assert "completed, 7 completion tokens" in caplog.text
        await run(ALLOW)
    finally:
        await engine.dispose()


def test_refused_writes_wait_in_a_bounded_queue(
    postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    run_migrated(postgres_url, lambda url: _exercise(url, caplog))
