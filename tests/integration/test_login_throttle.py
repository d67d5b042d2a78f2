"""The admin login throttle against real databases: failures per client address over a sliding
window, counted in the database so that two throttles on one database (two gateways) count
them together; another address is not held up, a success clears the address, and failures
that left the window are swept."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select

from gateway.api.admin_auth import LoginThrottle
from gateway.db.models import AdminLoginFailure
from gateway.db.session import create_engine, create_sessionmaker
from gateway.stores.login_failures import LoginFailureStore
from tests.support.migrated import run_migrated

DATABASES = ["sqlite_url", pytest.param("postgres_url", marks=pytest.mark.postgres)]
T0 = datetime(2026, 11, 23, 10, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


async def _exercise(url: str) -> None:
    engine = create_engine(url)
    sessions = create_sessionmaker(engine)
    try:
        # Two gateways: each its own throttle, one database.
        first = LoginThrottle(LoginFailureStore(sessions), limit=3, window_s=60)
        second = LoginThrottle(LoginFailureStore(sessions), limit=3, window_s=60)
        for i, throttle in enumerate((first, second, first)):
            assert await throttle.retry_after_s("10.0.0.1", at(i)) is None
            await throttle.failed("10.0.0.1", at(i))
        # Held on both, until the oldest of the three leaves the window.
        assert await second.retry_after_s("10.0.0.1", at(10)) == pytest.approx(50)
        assert await first.retry_after_s("10.0.0.1", at(10)) == pytest.approx(50)
        assert await first.retry_after_s("10.0.0.2", at(10)) is None  # another address
        assert await first.retry_after_s("10.0.0.1", at(60.5)) is None
        # A success clears the address.
        await first.failed("10.0.0.1", at(61))
        await second.succeeded("10.0.0.1")
        assert await first.retry_after_s("10.0.0.1", at(62)) is None
        # Failures past the window are swept as new ones come.
        await first.failed("10.0.0.9", at(500))
        async with sessions() as session:
            left = await session.scalar(select(func.count()).select_from(AdminLoginFailure))
        assert left == 1
    finally:
        await engine.dispose()


@pytest.mark.parametrize("database", DATABASES)
def test_login_throttle_across_gateways(database: str, request: pytest.FixtureRequest) -> None:
    run_migrated(request.getfixturevalue(database), _exercise)
