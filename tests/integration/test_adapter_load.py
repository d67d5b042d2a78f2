"""The dashboard's per-adapter load (gateway/stores/adapter_load.py) over real request rows:
grouped by base model and adapter, busiest first, the window's rows only, base-model requests
and unanswered tokens left out of the adapters' counts."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from gateway.db.migrate import downgrade, upgrade
from gateway.db.models import InferenceRequest, RequestStatus, utcnow
from gateway.db.session import create_engine, create_sessionmaker
from gateway.stores.adapter_load import AdapterLoad, adapter_load

DATABASES = ["sqlite_url", pytest.param("postgres_url", marks=pytest.mark.postgres)]


@pytest.mark.parametrize("database", DATABASES)
def test_adapter_load_groups_the_window(database: str, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue(database)
    upgrade(url)
    now = utcnow()
    # (model, adapter, prompt tokens, completion tokens or None while answering, age in s)
    rows = [
        ("m", "ft-a", 10, 5, 10),
        ("m", "ft-a", 20, None, 20),
        ("m", "ft-b", 7, 3, 30),
        ("m", "ft-a", 1000, 1000, 7200),  # before the window
        ("m", None, 500, 500, 10),  # the base model itself
        ("n", "ft-a", 4, 4, 10),  # another base's adapter of the same name
    ]

    async def run() -> list[AdapterLoad]:
        engine = create_engine(url)
        sessions = create_sessionmaker(engine)
        try:
            async with sessions() as session, session.begin():
                for i, (model, adapter, prompt, answer, age_s) in enumerate(rows):
                    session.add(InferenceRequest(
                        id=f"r{i}", api="completions", model=model, adapter=adapter,
                        status=RequestStatus.COMPLETED if answer else RequestStatus.DISPATCHED,
                        stream=False, prompt_tokens=prompt, max_tokens=64,
                        completion_tokens=answer, routing_policy="mico",
                        created_at=now - timedelta(seconds=age_s),
                    ))  # fmt: skip
            return await adapter_load(sessions, now - timedelta(hours=1))
        finally:
            await engine.dispose()

    try:
        loads = asyncio.run(run())
    finally:
        # The worker's PostgreSQL database is shared by its tests: these rows (ids r0..r5) broke
        # test_load_history's inserts of the same ids when it ran after this one in CI.
        downgrade(url)
    assert loads == [
        AdapterLoad("m", "ft-a", requests=2, prompt_tokens=30, completion_tokens=5),
        AdapterLoad("m", "ft-b", requests=1, prompt_tokens=7, completion_tokens=3),
        AdapterLoad("n", "ft-a", requests=1, prompt_tokens=4, completion_tokens=4),
    ]
