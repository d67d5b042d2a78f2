"""Finding 10 (accounting): outcome writes gave up after about a minute. A request's outcome
(its status and the tokens it generated) is what a key's usage is summed from; when the
database refused the write, it was retried 8 times over ~36 s and then dropped, so a database
outage longer than that left the answers served but never counted: usage undercounted.

The outage is real PostgreSQL refusing every update of `requests` (a trigger raising SQLSTATE
57P01, what a restarting server sends) for 45 s while a key's requests are answered. The
outcomes now wait in a bounded backlog that /metrics shows, and are written once the database
takes them: the key's usage then matches what its clients were told, to the token.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from gateway.db.migrate import downgrade
from tests.e2e.conftest import Federation
from tests.support.api_keys import make_key
from tests.support.migrated import execute_sql

pytestmark = [pytest.mark.slow, pytest.mark.postgres]
ADMIN = "admin-token-for-the-usage-tests"
# Longer than the ~36 s the outcome writes used to be retried for.
OUTAGE_S = 45
OUTAGE = (
    "CREATE TABLE outage (since timestamptz)",
    """CREATE FUNCTION refuse_during_outage() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
      IF EXISTS (SELECT 1 FROM outage) THEN
        RAISE EXCEPTION 'terminating connection due to administrator command'
          USING ERRCODE = '57P01';
      END IF;
      RETURN NEW;
    END $$""",
    "CREATE TRIGGER refuse_during_outage BEFORE INSERT OR UPDATE ON requests "
    "FOR EACH ROW EXECUTE FUNCTION refuse_during_outage()",
)
CLEAN_UP = (
    "DROP TRIGGER IF EXISTS refuse_during_outage ON requests",
    "DROP FUNCTION IF EXISTS refuse_during_outage()",
    "DROP TABLE IF EXISTS outage",
)


@pytest.fixture(scope="module")
def federation(start_federation, postgres_url: str) -> Iterator[Federation]:
    env = {"GATEWAY_ADMIN_TOKEN": ADMIN, "GATEWAY_REQUIRE_API_KEYS": "true"}
    started: Federation = start_federation(live=["aws-use1"], database_url=postgres_url, env=env)
    try:
        execute_sql(postgres_url, *OUTAGE)
        yield started
    finally:
        execute_sql(postgres_url, *CLEAN_UP)
        started.gateway.stop()
        downgrade(postgres_url)  # the session's database is shared: leave it empty


def backlog(federation: Federation) -> float:
    metrics = httpx.get(
        f"{federation.base_url}/metrics", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10
    ).text
    line = next(
        line for line in metrics.splitlines() if line.startswith("fedllm_gateway_outcome_backlog ")
    )
    return float(line.split()[1])


def test_usage_served_during_an_outage_is_counted_once_the_database_is_back(
    federation: Federation,
) -> None:
    key = make_key(federation.base_url, ADMIN, "counted")
    execute_sql(federation.database_url, "INSERT INTO outage VALUES (now())")
    answers = [
        httpx.post(
            f"{federation.base_url}/v1/completions",
            json={
                "model": "tiny",
                "prompt": f"Outage {n}",
                "max_tokens": 5 + n,
                "ignore_eos": True,
            },
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        )
        for n in range(3)
    ]
    assert [a.status_code for a in answers] == [200, 200, 200], answers[-1].text
    assert backlog(federation) == 3  # served, not yet counted: visible to the operator
    time.sleep(OUTAGE_S)
    assert backlog(federation) == 3  # still kept, not given up
    execute_sql(federation.database_url, "DELETE FROM outage")
    deadline = time.monotonic() + 30
    while backlog(federation) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert backlog(federation) == 0
    ((key_id,),) = federation.query("SELECT id FROM api_keys WHERE name = 'counted'")
    usage = httpx.get(
        f"{federation.base_url}/admin/api/keys/{key_id}/usage",
        headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=10,
    ).json()
    told = [a.json()["usage"] for a in answers]
    assert usage["requests"] == 3
    assert usage["prompt_tokens"] == sum(u["prompt_tokens"] for u in told)
    assert usage["completion_tokens"] == sum(u["completion_tokens"] for u in told) == 5 + 6 + 7
    assert {row["status"] for row in federation.rows()} == {"completed"}
