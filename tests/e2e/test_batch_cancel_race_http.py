"""Issue 32, finding 9: the batch cancel race. A clean clone's CI failed once on
test_batches_http.py::test_cancel_stops_queued_and_running_items: an item recorded `cancelled`
while its request row said `completed`.

The interleaving: an item's answer is complete (its dispatch queued the request row's
`completed` outcome, tokens and all, for the request log) and the runner is recording the item
final when the batch's cancel reaches the item's task. The cancel interrupted that write (rolled
back) and the runner recorded the item cancelled instead; the request log then wrote the row
completed. One outcome must win, in the item and its request row alike, with its usage.

Forced here on a real gateway and real PostgreSQL, with no timing in it: a trigger makes the
item's final write wait on an advisory lock the test holds; once the answer is recorded and the
write waits, the test cancels the batch, then makes one more request to the gateway (the
cancel was delivered to the item's task before the gateway reads it: a task's cancellation runs
at the next turn of the event loop), then releases the lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from sqlalchemy import Connection, create_engine, text

from gateway.db.migrate import downgrade, sync_url
from tests.e2e.batch_client import FINAL
from tests.e2e.conftest import Federation
from tests.support.migrated import execute_sql

pytestmark = [pytest.mark.slow, pytest.mark.postgres]
LOCK = 3232
HOLD_FINAL_WRITES = (
    f"""CREATE FUNCTION hold_final_items() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
      IF OLD.status = 'running' AND NEW.status IN ('completed', 'failed', 'cancelled') THEN
        PERFORM pg_advisory_xact_lock_shared({LOCK});
      END IF;
      RETURN NEW;
    END $$""",
    "CREATE TRIGGER hold_final_items BEFORE UPDATE ON batch_items "
    "FOR EACH ROW EXECUTE FUNCTION hold_final_items()",
)
CLEAN_UP = (
    "DROP TRIGGER IF EXISTS hold_final_items ON batch_items",
    "DROP FUNCTION IF EXISTS hold_final_items()",
)
WAITING = (
    f"SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = {LOCK} AND NOT granted"
)


@pytest.fixture(scope="module")
def federation(start_federation, postgres_url: str) -> Iterator[Federation]:
    started: Federation = start_federation(live=["aws-use1"], database_url=postgres_url)
    try:
        execute_sql(postgres_url, *HOLD_FINAL_WRITES)
        yield started
    finally:
        execute_sql(postgres_url, *CLEAN_UP)
        started.gateway.stop()
        downgrade(postgres_url)


@pytest.fixture
def lock(federation: Federation) -> Iterator[Connection]:
    engine = create_engine(sync_url(federation.database_url), isolation_level="AUTOCOMMIT")
    with engine.connect() as connection:
        connection.execute(text(f"SELECT pg_advisory_lock({LOCK})"))
        try:
            yield connection
        finally:
            connection.execute(text("SELECT pg_advisory_unlock_all()"))
    engine.dispose()


def _until(condition: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout_s}s for {what}"
        time.sleep(0.05)


def test_a_finished_answer_is_never_reported_cancelled(
    federation: Federation, lock: Connection
) -> None:
    with httpx.Client(base_url=federation.base_url, timeout=30) as client:
        item = {"custom_id": "done", "prompt": "Count", "max_tokens": 4, "ignore_eos": True}
        batch = client.post("/v1/batches", json={"model": "tiny", "requests": [item]}).json()
        request_sql = (
            "SELECT r.status FROM batch_items i JOIN requests r ON r.id = i.request_id "
            f"WHERE i.batch_id = '{batch['id']}'"
        )
        # The answer is complete and recorded, and the item's final write waits on the lock.
        _until(lambda: federation.query(request_sql) == [("completed",)], "the request row")
        _until(lambda: lock.execute(text(WAITING)).scalar() == 1, "the item's final write")
        cancelled = client.post(f"/v1/batches/{batch['id']}/cancel")
        assert cancelled.status_code == 200, cancelled.text
        assert client.get("/healthz").status_code == 200  # the cancel reached the item's task
        lock.execute(text(f"SELECT pg_advisory_unlock({LOCK})"))
        _until(lambda: client.get(f"/v1/batches/{batch['id']}").json()["status"] in FINAL, "end")
        results = client.get(f"/v1/batches/{batch['id']}/results").json()["data"]
    both = federation.query(
        "SELECT i.status, r.status, r.completion_tokens FROM batch_items i "
        f"JOIN requests r ON r.id = i.request_id WHERE i.batch_id = '{batch['id']}'"
    )
    assert both == [("completed", "completed", 4)]  # one outcome, with its usage
    assert [r["status"] for r in results] == ["completed"]
    assert results[0]["response"]["usage"]["completion_tokens"] == 4
