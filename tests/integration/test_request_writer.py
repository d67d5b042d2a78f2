"""The request log written behind the requests (gateway/stores/request_writer.py), on SQLite and
PostgreSQL: many requests per transaction, a request that ends before its row was written costs
one insert, offloads and samples land after the row they point at, flush() waits for what was
written before it, and a row the database refuses for what it holds is dropped alone instead of
holding every other request's row back."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from sqlalchemy import select

from gateway.db.models import InferenceRequest, LengthSample, OffloadEvent, RequestStatus, Site
from gateway.db.session import create_engine, create_sessionmaker
from gateway.stores.request_log import LogBatch, NewRequest, NewSample, Outcome, RequestLog
from gateway.stores.request_writer import RequestLogWriter
from tests.support.migrated import run_migrated

DATABASES = ["sqlite_url", pytest.param("postgres_url", marks=pytest.mark.postgres)]
DONE = Outcome(RequestStatus.COMPLETED, 1, 1, 7, "stop")


class CountingLog(RequestLog):
    """Counts the transactions the writer opens."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.batches: list[int] = []

    async def write(self, batch: LogBatch) -> None:
        self.batches.append(len(batch))
        await super().write(batch)


def _new(request_id: str, site_id: int | None = 1, api_key_id: int | None = None) -> NewRequest:
    return NewRequest(
        request_id, "completions", "m", False, None, 3, 16, "mico", site_id, api_key_id=api_key_id
    )


async def _exercise(url: str, caplog: pytest.LogCaptureFixture) -> None:
    engine = create_engine(url)
    sessions = create_sessionmaker(engine)
    try:
        async with sessions.begin() as session:
            session.add_all(
                [
                    Site(
                        id=site_id,
                        name=f"s{site_id}",
                        cloud="c",
                        region="r",
                        endpoint="e",
                        model="m",
                    )
                    for site_id in (1, 2)
                ]
            )
        log = CountingLog(sessions)
        writer = RequestLogWriter(log, flush_s=0.05)
        # A burst: 20 requests accepted and finished within one flush interval.
        for n in range(20):
            writer.accepted(_new(f"burst-{n}"))
        for n in range(20):
            writer.finished(f"burst-{n}", DONE, NewSample("m", f"p{n}", 3, 7, False, 5))
        assert len(writer) == 20
        # Accepted, offloaded and finished across flushes: insert, then the event and updates.
        writer.accepted(_new("slow"))
        await writer.flush()
        assert log.batches == [20 + 1]  # one transaction, one insert per request
        writer.offloaded("slow", 1, 2)
        await writer.flush()
        writer.finished("slow", Outcome(RequestStatus.FAILED, 2, 2, 0, error="gone"))
        # A row the database will never take (its key does not exist) is dropped alone.
        writer.accepted(_new("bad-key", api_key_id=999))
        writer.accepted(_new("after-bad"))
        with caplog.at_level(logging.ERROR, logger="gateway.stores.request_writer"):
            await writer.flush()
        assert "refused bad-key; dropped" in caplog.text
        assert len(writer) == 0
        async with sessions() as session:
            rows = {row.id: row for row in await session.scalars(select(InferenceRequest))}
            samples = set(await session.scalars(select(LengthSample.request_id)))
            moved = select(OffloadEvent.request_id, OffloadEvent.to_site_id)
            offloads = [tuple(row) for row in await session.execute(moved)]
        assert set(rows) == {f"burst-{n}" for n in range(20)} | {"slow", "after-bad"}
        assert {rows[f"burst-{n}"].status for n in range(20)} == {RequestStatus.COMPLETED}
        assert rows["burst-3"].completion_tokens == 7
        assert rows["burst-3"].finished_at is not None
        assert rows["burst-3"].dispatched_at is not None
        assert samples == {f"burst-{n}" for n in range(20)}
        assert offloads == [("slow", 2)]
        slow = rows["slow"]
        assert (slow.status, slow.site_id, slow.attempts, slow.error) == (
            RequestStatus.FAILED,
            2,
            2,
            "gone",
        )
        assert rows["after-bad"].status == RequestStatus.DISPATCHED
        await writer.drain(timeout_s=1)
    finally:
        await engine.dispose()


@pytest.mark.parametrize("database", DATABASES)
def test_the_request_log_is_written_in_batches_behind_the_requests(
    database: str, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    url = request.getfixturevalue(database)
    run_migrated(url, lambda migrated: _exercise(migrated, caplog))


async def _offload_before_the_row(url: str) -> None:
    engine = create_engine(url)
    sessions = create_sessionmaker(engine)
    try:
        async with sessions.begin() as session:
            session.add_all(
                [
                    Site(id=i, name=f"s{i}", cloud="c", region="r", endpoint="e", model="m")
                    for i in (1, 2)
                ]
            )
        writer = RequestLogWriter(RequestLog(sessions), flush_s=10.0)
        writer.accepted(_new("moved"))
        writer.offloaded("moved", 1, 2)  # before the row was written: the row says site 2
        flushed = asyncio.create_task(writer.flush())
        await asyncio.wait_for(flushed, 5)  # a waiter does not wait out flush_s
        async with sessions() as session:
            row = await session.get(InferenceRequest, "moved")
        assert row is not None
        assert row.site_id == 2
        await writer.drain(timeout_s=1)
    finally:
        await engine.dispose()


def test_an_offload_before_the_row_is_written_lands_in_the_row(sqlite_url: str) -> None:
    run_migrated(sqlite_url, _offload_before_the_row)


async def _free_text_refused(url: str) -> None:
    engine = create_engine(url)
    sessions = create_sessionmaker(engine)
    try:
        async with sessions.begin() as session:
            session.add(Site(id=1, name="s1", cloud="c", region="r", endpoint="e", model="m"))
        writer = RequestLogWriter(RequestLog(sessions), flush_s=0.01)
        # PostgreSQL's json refuses NaN: the row as a whole is refused for what it holds.
        odd = NewRequest(
            "odd", "completions", "m", False, "someone", 3, 16, "mico", 1,
            routing_detail={"scores": {"s1": float("nan")}},
        )  # fmt: skip
        writer.accepted(odd)
        writer.finished("odd", DONE, NewSample("m", "p", 3, 7, False, 5))
        writer.accepted(_new("fine"))
        await writer.flush()
        async with sessions() as session:
            rows = {row.id: row for row in await session.scalars(select(InferenceRequest))}
        assert set(rows) == {"odd", "fine"}
        kept = rows["odd"]
        # What usage is summed from is written; the free-form columns are left out.
        assert (kept.status, kept.completion_tokens, kept.prompt_tokens) == (
            RequestStatus.COMPLETED,
            7,
            3,
        )
        assert (kept.routing_detail, kept.user) == (None, None)
        await writer.drain(timeout_s=1)
    finally:
        await engine.dispose()


@pytest.mark.postgres
def test_a_row_refused_for_what_it_holds_is_still_written_for_its_usage(
    postgres_url: str,
) -> None:
    run_migrated(postgres_url, _free_text_refused)
