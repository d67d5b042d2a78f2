"""The dashboard's history against real databases: samples downsampled in SQL (both dialects'
bucket arithmetic), per-cloud sums, latency weighting, retention, drift, offloads, and the
sampler writing what the live site view says."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import delete, func, select, update

from gateway.admin import series as admin_series
from gateway.admin.load_sampler import LoadSampler
from gateway.db.migrate import downgrade, upgrade
from gateway.db.models import InferenceRequest, LoadRollup, LoadSample, RequestStatus, utcnow
from gateway.db.session import create_engine, create_sessionmaker
from gateway.federation import SiteConfig
from gateway.sites.grpc_client import GrpcSiteClient
from gateway.sites.interface import LoadView
from gateway.sites.registry import SiteRegistry, SiteState
from gateway.stores.load_history import (
    ROLLUP_S,
    NewLoadSample,
    Sessions,
    SiteRef,
    Window,
    delete_samples_before,
    load_buckets,
    roll_up,
    rolled_until,
    site_directory,
    write_samples,
)
from gateway.stores.request_history import drift_buckets, offloads_since, recent_stats
from gateway.stores.request_log import NewRequest, Outcome, RequestLog
from gateway.stores.site_store import sync_sites

DATABASES = ["sqlite_url", pytest.param("postgres_url", marks=pytest.mark.postgres)]
A = SiteConfig("a", "aws", "us-east-1", "127.0.0.1:1", "m")
B = SiteConfig("b", "gcp", "europe-west4", "127.0.0.1:2", "m")
C = SiteConfig("c", "aws", "us-west-2", "127.0.0.1:3", "m")
BASE = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)  # a multiple of 60 s


def sample(
    site_id: int, queued: int, completed: int = 0, ttft: float | None = None
) -> NewLoadSample:
    return NewLoadSample(
        site_id=site_id,
        queued_tokens=queued,
        running_tokens=2 * queued,
        predicted_remaining_tokens=3,
        queued_requests=1,
        running_requests=0,
        completed_requests=completed,
        ttft_mean_ms=ttft,
        ttft_p50_ms=ttft,
        e2e_mean_ms=None if ttft is None else ttft * 10,
        e2e_p50_ms=None,
        healthy=queued % 20 == 0,
    )


async def check_buckets(sessions: Sessions, ids: dict[str, int]) -> None:
    a, b, c = ids["a"], ids["b"], ids["c"]
    # Every 10 s for 3 minutes, plus one sample on each side of the window.
    for t in range(-10, 190, 10):
        at = BASE + timedelta(seconds=t)
        rows = [sample(a, t), sample(b, 1000), sample(c, 1)]
        if t == 20:
            rows[0] = sample(a, t, completed=2, ttft=100.0)
        if t == 30:
            rows[0] = sample(a, t, completed=1, ttft=400.0)
        if t == 40:
            rows[0] = sample(a, t, completed=3)  # finished, but no first token recorded
        await write_samples(sessions, at, rows)
    window = Window(int(BASE.timestamp()), 60, 3)
    buckets = {(x.site_id, x.index): x for x in await load_buckets(sessions, window)}
    assert sorted({i for _, i in buckets}) == [0, 1, 2]  # -10 s and 180 s are outside
    first = buckets[(a, 0)]
    assert first.samples == 6
    assert first.queued_tokens_sum == pytest.approx(150.0)  # 0 + 10 + ... + 50
    assert buckets[(a, 1)].queued_tokens_sum == pytest.approx(510.0)
    assert buckets[(a, 2)].running_tokens_sum == pytest.approx(2 * 870.0)
    assert first.completed_requests == 6
    assert first.ttft_ms_weighted == pytest.approx(600.0)
    assert first.ttft_weight == 3
    assert first.healthy_samples == 3

    directory = await site_directory(sessions)
    aws, gcp = admin_series.cloud_series(buckets.values(), directory, window)
    assert (aws.key, gcp.key) == ("aws", "gcp")
    assert aws.queued_tokens == [26, 86, 146]  # site a + site c, bucket by bucket
    assert aws.token_load == [26 + 52 + 6, 86 + 172 + 6, 146 + 292 + 6]
    assert gcp.queued_tokens == [1000, 1000, 1000]
    assert aws.completed == [6, 0, 0]
    assert aws.requests_per_min == [6.0, 0.0, 0.0]
    assert aws.ttft_ms == [200.0, None, None]  # (2 * 100 + 1 * 400) / 3, not a mean of means
    assert aws.e2e_ms == [2000.0, None, None]
    only_a = admin_series.site_series(await load_buckets(sessions, window, a), directory[a], window)
    assert only_a.queued_tokens == [25, 85, 145]

    # A finer step over the same rows: one sample per bucket, values as written.
    fine = Window(int(BASE.timestamp()), 10, 18)
    (series,) = [s for s in admin_series.cloud_series(
        await load_buckets(sessions, fine), directory, fine
    ) if s.key == "gcp"]  # fmt: skip
    assert series.queued_tokens == [1000] * 18

    await check_rollups(sessions, directory)
    # Retention: rollups of periods that started before the cutoff go, samples before it go.
    assert await delete_samples_before(sessions, BASE + timedelta(seconds=60)) == 0
    async with sessions() as session:
        rollups = await session.scalar(select(func.count()).select_from(LoadRollup))
    assert rollups == 0
    assert await delete_samples_before(sessions, BASE + timedelta(seconds=ROLLUP_S + 11)) == 1
    async with sessions() as session:
        assert await session.scalar(select(func.count()).select_from(LoadSample)) == 0


async def check_rollups(sessions: Sessions, directory: dict[int, SiteRef]) -> None:
    """Reading 5-minute rollups gives exactly what reading the samples gave."""
    day = Window(int(BASE.timestamp()) - ROLLUP_S, ROLLUP_S, 3)
    from_samples = admin_series.cloud_series(await load_buckets(sessions, day), directory, day)
    assert await rolled_until(sessions) is None
    assert await roll_up(sessions, BASE + timedelta(seconds=ROLLUP_S + 5)) == 3 * 2
    assert await roll_up(sessions, BASE + timedelta(seconds=ROLLUP_S + 9)) == 0  # done already
    assert await rolled_until(sessions) == BASE + timedelta(seconds=ROLLUP_S)
    async with sessions() as session:
        await session.execute(
            delete(LoadSample).where(LoadSample.bucket_at < BASE + timedelta(seconds=ROLLUP_S))
        )
        await session.commit()
    from_rollups = admin_series.cloud_series(await load_buckets(sessions, day), directory, day)
    assert from_rollups == from_samples
    # A sample after the last rolled-up period is read raw and lands in its own bucket.
    b = next(i for i, ref in directory.items() if ref.name == "b")
    await write_samples(sessions, BASE + timedelta(seconds=ROLLUP_S + 10), [sample(b, 7)])
    gcp = next(
        s
        for s in admin_series.cloud_series(await load_buckets(sessions, day), directory, day)
        if s.key == "gcp"
    )
    assert gcp.queued_tokens == [1000, 1000, 7]


async def check_requests(sessions: Sessions, ids: dict[str, int]) -> None:
    log = RequestLog(sessions)
    started = utcnow()
    for i, (predicted, actual) in enumerate([(10, 4), (20, 26), (7, 7)]):
        request_id = f"r{i}"
        await log.accepted(
            NewRequest(
                request_id, "completions", "m", True, None, 5, 64, "mico", ids["a"], predicted
            )
        )
        await log.finished(
            request_id,
            Outcome(RequestStatus.COMPLETED, ids["a"], 1, actual, "stop", first_token_at=utcnow()),
        )
    await log.accepted(NewRequest("x", "completions", "m", False, None, 5, 64, "mico", ids["b"]))
    await log.offloaded("r1", ids["a"], ids["b"])  # r1 now belongs to b
    window = Window(int(started.timestamp()) // 60 * 60 - 60, 60, 3)
    drift = await drift_buckets(sessions, window)
    on_a = [d for d in drift if d.site_id == ids["a"]]
    assert sum(d.count for d in on_a) == 2
    assert sum(d.predicted_sum for d in on_a) == 17
    assert sum(d.actual_sum for d in on_a) == 11
    assert sum(d.error_sum for d in on_a) == 6
    assert sum(d.abs_error_sum for d in on_a) == 6
    directory = await site_directory(sessions)
    summary = admin_series.drift(drift, directory, window)
    # The summary alone (one GROUP BY over the window, no buckets) says exactly the same.
    flat = await drift_buckets(sessions, window, bucketed=False)
    only_summary = admin_series.drift(flat, directory, window, series=False)
    assert only_summary.summary == summary.summary
    assert only_summary.series == []
    assert [s.site for s in summary.series] == ["a", "b"]
    assert [(s.site, s.count, s.bias, s.mae, s.mean_actual) for s in summary.summary] == [
        ("a", 2, 3.0, 3.0, 5.5),
        ("b", 1, -6.0, 6.0, 26.0),
    ]

    stats = await recent_stats(
        sessions, started - timedelta(seconds=1), utcnow(), timedelta(seconds=600)
    )
    assert stats[ids["a"]].completed == 2
    assert stats[ids["b"]].completed == 1
    async with sessions() as session:
        rows = (await session.execute(select(InferenceRequest))).scalars().all()
    durations_on_a = [
        (r.finished_at - r.created_at).total_seconds()
        for r in rows
        if r.site_id == ids["a"] and r.finished_at is not None
    ]
    # SQLite keeps timestamps to the millisecond, so each row's duration may be off by up to
    # 1 ms there, and the sum by up to 1 ms per row (CI once saw 1.2 ms over two rows).
    tolerance = 1e-3 * len(durations_on_a)
    assert stats[ids["a"]].e2e_s_sum == pytest.approx(sum(durations_on_a), abs=tolerance)
    assert stats[ids["a"]].ttft_count == 2

    total, events = await offloads_since(sessions, started - timedelta(seconds=1), 10)
    assert total == 1
    assert events[0].request_id == "r1"
    assert (events[0].from_site_id, events[0].to_site_id) == (ids["a"], ids["b"])
    assert (await offloads_since(sessions, started, 10, ids["c"]))[0] == 0


async def check_sampler(sessions: Sessions, ids: dict[str, int]) -> None:
    states = [
        SiteState(
            config=cfg, site_id=ids[cfg.name], client=GrpcSiteClient(cfg.name, cfg.endpoint, 1)
        )
        for cfg in (A, B, C)
    ]
    registry = SiteRegistry(states)
    try:
        states[0].mark_unhealthy("down for the test")
        states[1].healthy = True
        states[1].apply_report(LoadView(2, 3, 40, 50, 60, 1, 10, 100.0, 1, 1))
        since = utcnow()
        await RequestLog(sessions).accepted(
            NewRequest("s1", "completions", "m", False, None, 5, 8, "mico", ids["b"])
        )
        await RequestLog(sessions).finished(
            "s1",
            Outcome(RequestStatus.COMPLETED, ids["b"], 1, 8, "length", first_token_at=utcnow()),
        )
        sampler = LoadSampler(
            registry, sessions, interval_s=1, retention_s=3600, request_timeout_s=600
        )
        until = await sampler.sample_once(since)
        async with sessions() as session:
            written = {
                row.site_id: row
                for row in (
                    await session.execute(select(LoadSample).where(LoadSample.bucket_at == until))
                ).scalars()
            }
        b = written[ids["b"]]
        assert (b.queued_tokens, b.running_tokens, b.predicted_remaining_tokens) == (40, 50, 60)
        assert (b.queued_requests, b.running_requests, b.healthy) == (2, 3, True)
        assert b.completed_requests == 1
        assert b.e2e_mean_ms is not None
        assert b.e2e_p50_ms == pytest.approx(b.e2e_mean_ms)
        a = written[ids["a"]]
        assert (a.queued_tokens, a.completed_requests, a.healthy, a.ttft_mean_ms) == (
            0, 0, False, None,
        )  # fmt: skip
        # The next sample covers only what finished after `until`.
        later = await sampler.sample_once(until)
        async with sessions() as session:
            again = await session.scalar(
                select(LoadSample.completed_requests).where(
                    LoadSample.bucket_at == later, LoadSample.site_id == ids["b"]
                )
            )
        assert again == 0
        # A row written after the sample that covered its finish (the outcome write lags the
        # stream's end) is counted by the next sample, once.
        await RequestLog(sessions).accepted(
            NewRequest("s2", "completions", "m", False, None, 5, 8, "mico", ids["b"])
        )
        await RequestLog(sessions).finished(
            "s2", Outcome(RequestStatus.COMPLETED, ids["b"], 1, 8, "length")
        )
        async with sessions() as session, session.begin():
            await session.execute(
                update(InferenceRequest)
                .where(InferenceRequest.id == "s2")
                .values(finished_at=until + (later - until) / 2)
            )
        counts = []
        for _ in range(2):
            later = await sampler.sample_once(later)
            async with sessions() as session:
                counts.append(
                    await session.scalar(
                        select(LoadSample.completed_requests).where(
                            LoadSample.bucket_at == later, LoadSample.site_id == ids["b"]
                        )
                    )
                )
        assert counts == [1, 0]
    finally:
        await registry.close()


@pytest.mark.parametrize("database", DATABASES)
def test_history_queries(database: str, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue(database)
    upgrade(url)

    async def run() -> None:
        engine = create_engine(url)
        sessions = create_sessionmaker(engine)
        try:
            ids = await sync_sites(sessions, (A, B, C))
            await check_buckets(sessions, ids)
            await check_requests(sessions, ids)
            await check_sampler(sessions, ids)
        finally:
            await engine.dispose()

    try:
        asyncio.run(run())
    finally:
        downgrade(url)
