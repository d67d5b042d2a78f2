"""The predictor registry against real databases: one active version per served model, the
default ("") apart, and a version that cannot change models."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import text

from gateway.db.migrate import downgrade, upgrade
from gateway.db.session import create_engine, create_sessionmaker
from gateway.stores.predictor_registry import DEFAULT_MODEL, PredictorRegistry

DATABASES = ["sqlite_url", pytest.param("postgres_url", marks=pytest.mark.postgres)]


async def exercise(url: str) -> None:
    engine = create_engine(url)
    registry = PredictorRegistry(create_sessionmaker(engine))

    async def add(version: str, model: str, activate: bool = True) -> None:
        await registry.register(
            version=version,
            path=f"/p/{version}",
            kind="sklearn",
            scheme="s",
            metrics={"v": version},
            activate=activate,
            model=model,
        )

    try:
        async with engine.begin() as connection:  # the Postgres database is shared by tests
            await connection.execute(text("DELETE FROM predictor_versions"))
        await add("d1", DEFAULT_MODEL)
        await add("a1", "model-a")
        await add("b1", "model-b")
        await add("a2", "model-a")  # replaces a1 for model-a only
        await add("b2", "model-b", activate=False)
        active = {model: v.version for model, v in (await registry.active_by_model()).items()}
        assert active == {DEFAULT_MODEL: "d1", "model-a": "a2", "model-b": "b1"}
        assert (await registry.active("model-a")).version == "a2"  # type: ignore[union-attr]
        assert await registry.active("model-c") is None  # no fallback here: callers choose
        with pytest.raises(ValueError, match="registered for model 'model-a'"):
            await add("a1", "model-b")
        assert (await registry.active("model-b")).version == "b1"  # type: ignore[union-attr]
        assert await registry.metrics_of("b2") == {"v": "b2"}
        assert [v.version for v in await registry.all()] == ["d1", "a1", "b1", "a2", "b2"]
    finally:
        await engine.dispose()


@pytest.mark.parametrize("database", DATABASES)
def test_one_active_version_per_model(database: str, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue(database)
    upgrade(url)
    asyncio.run(exercise(url))


@pytest.mark.parametrize("database", DATABASES)
def test_versions_from_before_are_the_default(database: str, request) -> None:
    """Migrating an existing registry: its versions become the default's, still active."""
    url = request.getfixturevalue(database)
    upgrade(url, "0010")
    engine = create_engine(url)

    async def old_row() -> None:
        async with engine.begin() as connection:
            await connection.execute(text("DELETE FROM predictor_versions"))
            await connection.execute(text(
                "INSERT INTO predictor_versions (version, path, kind, scheme, metrics, active, "
                "created_at) VALUES ('old', '/p/old', 'minilm', 's', '{}', true, "
                "CURRENT_TIMESTAMP)"
            ))  # fmt: skip
        await engine.dispose()

    async def drop_old_row() -> None:
        cleanup = create_engine(url)
        async with cleanup.begin() as connection:
            await connection.execute(text("DELETE FROM predictor_versions WHERE version = 'old'"))
        await cleanup.dispose()

    asyncio.run(old_row())
    try:
        upgrade(url)
        registry = PredictorRegistry(create_sessionmaker(create_engine(url)))
        active = asyncio.run(registry.active_by_model())
        assert {model: v.version for model, v in active.items()} == {DEFAULT_MODEL: "old"}
        downgrade(url, "0010")
    finally:
        # The session's PostgreSQL database is shared: an active version whose files do not
        # exist would stop every gateway started on it later.
        asyncio.run(drop_old_row())
