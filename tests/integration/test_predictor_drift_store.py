"""The drift signal's store and the retrain job queue against real databases: each model's window
of the version serving it, one open job per model, claims that never run a job twice, failures
recorded (also of a job whose process crashed), and drift queueing a job once."""

from __future__ import annotations

import asyncio
import sys
import uuid
from datetime import timedelta

import pytest
from sqlalchemy import text

from gateway.admin.predictor_health import PredictorHealth
from gateway.admin.retrain_worker import RetrainWorker
from gateway.db.models import InferenceRequest, LengthSample, RequestStatus, utcnow
from gateway.db.session import create_engine, create_sessionmaker
from gateway.drift_settings import DriftSettings, RetrainSettings
from gateway.metrics import GatewayMetrics
from gateway.stores.predictor_error import served_windows
from gateway.stores.retrain_jobs import JobAlreadyOpen, RetrainJobStore
from tests.support.migrated import run_migrated

DATABASES = ["sqlite_url", pytest.param("postgres_url", marks=pytest.mark.postgres)]


async def _clear(url: str) -> None:
    engine = create_engine(url)
    async with engine.begin() as connection:  # the Postgres database is shared by tests
        for table in ("retrain_jobs", "length_samples", "requests"):
            await connection.execute(text(f"DELETE FROM {table}"))
    await engine.dispose()


async def _served(
    url: str, model: str, version: str, pairs: list[tuple[int, int]], *, censored: bool = False,
    age_s: float = 0.0,
) -> None:  # fmt: skip
    """Finished requests with their samples, oldest first, one millisecond apart."""
    engine = create_engine(url)
    start = utcnow() - timedelta(seconds=age_s + len(pairs) / 1000)
    async with create_sessionmaker(engine).begin() as session:
        for i, (predicted, served) in enumerate(pairs):
            at = start + timedelta(milliseconds=i)
            rid = uuid.uuid4().hex
            session.add(InferenceRequest(
                id=rid, api="completions", model=model, status=RequestStatus.COMPLETED,
                stream=False, prompt_tokens=3, max_tokens=64, routing_policy="mico",
                predicted_tokens=predicted, predictor_version=version, created_at=at,
                completion_tokens=served,
            ))  # fmt: skip
            await session.flush()
            session.add(LengthSample(
                request_id=rid, model=model, prompt=f"p{i}", prompt_tokens=3,
                completion_tokens=served, censored=censored, predicted_tokens=predicted,
                created_at=at,
            ))  # fmt: skip
    await engine.dispose()


async def windows_exercise(url: str) -> None:
    await _clear(url)
    await _served(url, "a", "v1", [(10, 100)] * 5, age_s=10)  # the old version's error
    await _served(url, "a", "v2", [(i, i) for i in range(1, 8)])
    await _served(url, "a", "v2", [(50, 60)] * 3, censored=True)
    await _served(url, "b", "v1", [(5, 9)] * 4, age_s=3600)
    engine = create_engine(url)
    sessions = create_sessionmaker(engine)
    try:
        got = await served_windows(sessions, window_samples=5, since=None, include_censored=False)
        assert set(got) == {"a", "b"}
        assert got["a"].version == "v2"  # the newest sample's version: v1's are left out
        assert got["a"].pairs == [(7, 7), (6, 6), (5, 5), (4, 4), (3, 3)]  # newest 5, newest first
        assert got["b"].pairs == [(5, 9)] * 4
        with_cut = await served_windows(sessions, window_samples=4, since=None,
                                        include_censored=True)  # fmt: skip
        assert with_cut["a"].pairs == [(50, 60), (50, 60), (50, 60), (7, 7)]
        recent = await served_windows(sessions, window_samples=50,
                                      since=utcnow() - timedelta(seconds=60),
                                      include_censored=False)  # fmt: skip
        assert set(recent) == {"a"}  # b's samples are an hour old
    finally:
        await engine.dispose()


@pytest.mark.parametrize("database", DATABASES)
def test_a_models_window_is_its_serving_versions_newest(database, request) -> None:
    run_migrated(request.getfixturevalue(database), windows_exercise)


async def queue_exercise(url: str) -> None:
    await _clear(url)
    engine = create_engine(url)
    jobs = RetrainJobStore(create_sessionmaker(engine))
    try:
        first = await jobs.enqueue("a", reason="manual", mode="calibrate")
        assert first.state == "queued"
        assert first.started_at is None
        with pytest.raises(JobAlreadyOpen):
            await jobs.enqueue("a", reason="drift", mode="calibrate")
        other = await jobs.enqueue("b", reason="drift", mode="retrain", drift={"mae_ratio": 1.4})
        # Two workers race for the same job: exactly one gets it.
        claims = await asyncio.gather(*(jobs.claim(first.id) for _ in range(4)))
        assert [c.id for c in claims if c is not None] == [first.id]
        with pytest.raises(JobAlreadyOpen):  # running is open too
            await jobs.enqueue("a", reason="manual", mode="calibrate")
        assert await jobs.finish(first.id, version="v9", activated=False, decision={"x": 1})
        assert not await jobs.fail(first.id, "late")  # an ended job stays as it ended
        done = await jobs.get(first.id)
        assert done is not None
        assert done.state == "done"
        assert done.version == "v9"
        assert done.activated is False
        assert done.decision == {"x": 1}
        assert done.error is None
        again = await jobs.enqueue("a", reason="manual", mode="calibrate")  # a's job ended
        claimed = await jobs.claim()  # the oldest queued: b's
        assert claimed is not None
        assert claimed.id == other.id
        assert claimed.state == "running"
        assert claimed.drift == {"mae_ratio": 1.4}
        assert await jobs.fail_stale(utcnow() - timedelta(hours=1)) == 0  # it just started
        assert await jobs.fail_stale(utcnow() + timedelta(seconds=1)) == 1
        stale = await jobs.get(other.id)
        assert stale is not None
        assert stale.state == "failed"
        assert "abandoned" in (stale.error or "")
        latest = await jobs.latest_by_model()
        assert {m: j.id for m, j in latest.items()} == {"a": again.id, "b": other.id}
        assert [j.id for j in await jobs.recent(10)] == [again.id, other.id, first.id]
        assert [j.id for j in await jobs.recent(10, "a")] == [again.id, first.id]
    finally:
        await engine.dispose()


@pytest.mark.parametrize("database", DATABASES)
def test_the_job_queue(database, request) -> None:
    run_migrated(request.getfixturevalue(database), queue_exercise)


async def crash_exercise(url: str) -> None:
    await _clear(url)
    engine = create_engine(url)
    jobs = RetrainJobStore(create_sessionmaker(engine))
    crashing = [sys.executable, "-c", "import sys; print('training blew up'); sys.exit(3)"]
    worker = RetrainWorker(jobs, RetrainSettings(), url, command=crashing)
    try:
        assert await worker.run_once() is None  # nothing queued
        job = await jobs.enqueue("a", reason="manual", mode="calibrate")
        ended = await worker.run_once()
        assert ended is not None
        assert ended.id == job.id
        assert ended.state == "failed"
        assert ended.error is not None
        assert ended.error.startswith("exit status 3")
        assert "training blew up" in ended.error
        assert ended.finished_at is not None
    finally:
        await engine.dispose()


@pytest.mark.parametrize("database", DATABASES)
def test_a_crashed_job_is_recorded_as_failed(database, request) -> None:
    run_migrated(request.getfixturevalue(database), crash_exercise)


async def drift_exercise(url: str) -> None:
    await _clear(url)
    await _served(url, "a", "v1", [(10, 10 * (1 + i % 7)) for i in range(30)])  # 4x too low-ish
    await _served(url, "b", "v1", [(i, i) for i in range(1, 31)])  # perfect
    engine = create_engine(url)
    sessions = create_sessionmaker(engine)
    jobs = RetrainJobStore(sessions)
    drift = DriftSettings(window_samples=50, min_samples=20)
    retrain = RetrainSettings(on_drift=True, cooldown_s=3600)
    health = PredictorHealth(sessions, ["a", "b", "c"], drift, retrain, jobs)
    metrics = GatewayMetrics()
    health.watch(metrics)
    try:
        got = await health.refresh()
        assert got["a"].drifted
        assert not got["b"].drifted
        assert not got["c"].drifted
        assert got["c"].error is None
        queued = await jobs.recent(10)
        assert [(j.model, j.reason, j.state) for j in queued] == [("a", "drift", "queued")]
        assert queued[0].drift is not None
        assert queued[0].drift["version"] == "v1"
        await health.refresh()  # still drifted: the open job is enough
        assert len(await jobs.recent(10)) == 1
        exposition = metrics.exposition().decode()
        assert 'fedllm_gateway_predictor_drifted{model="a"} 1.0' in exposition
        assert 'fedllm_gateway_predictor_drifted{model="b"} 0.0' in exposition
        assert 'fedllm_gateway_predictor_rolling_samples{model="c"} 0.0' in exposition
        assert 'fedllm_gateway_predictor_rolling_spearman{model="b"} 1.0' in exposition
        assert 'fedllm_gateway_predictor_rolling_mae_tokens{model="b"} 0.0' in exposition
        assert 'fedllm_gateway_predictor_rolling_mae_ratio{model="c"}' not in exposition
    finally:
        await engine.dispose()


@pytest.mark.parametrize("database", DATABASES)
def test_drift_queues_one_job_and_shows_on_metrics(database, request) -> None:
    run_migrated(request.getfixturevalue(database), drift_exercise)
