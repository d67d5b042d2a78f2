"""Finding 8: the Idempotency-Key completion write was not retried. A database blip right after
the answer gave the client a 503 for an answer that was served (and charged), its retries 409
for the next ~10 minutes, and then a second run and a second charge.

The blip is real PostgreSQL refusing writes: a trigger makes the first few updates of
`idempotency_keys` fail with SQLSTATE 57P01 (admin_shutdown, what a restarting server sends),
counted by a sequence so the failures survive their own rollback.
"""

from __future__ import annotations

import httpx
import pytest
from sqlalchemy import create_engine, text

from gateway.db.migrate import downgrade, sync_url

pytestmark = pytest.mark.slow
FAILURES = 3
BLIP = f"""
CREATE SEQUENCE idempotency_blip;
CREATE FUNCTION idempotency_blip() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF nextval('idempotency_blip') <= {FAILURES} THEN
    RAISE EXCEPTION 'terminating connection due to administrator command' USING ERRCODE = '57P01';
  END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER idempotency_blip BEFORE UPDATE ON idempotency_keys
  FOR EACH ROW EXECUTE FUNCTION idempotency_blip();
"""
UNDO = """
DROP TRIGGER IF EXISTS idempotency_blip ON idempotency_keys;
DROP FUNCTION IF EXISTS idempotency_blip();
DROP SEQUENCE IF EXISTS idempotency_blip;
"""


def _execute(url: str, sql: str) -> None:
    engine = create_engine(sync_url(url))
    try:
        with engine.begin() as connection:
            connection.execute(text(sql))
    finally:
        engine.dispose()


def test_a_database_blip_after_the_answer_costs_neither_the_answer_nor_a_second_run(
    start_federation, postgres_url: str
) -> None:
    federation = start_federation(live=["aws-use1"], database_url=postgres_url)
    try:
        _execute(postgres_url, BLIP)
        body = {"model": "tiny", "prompt": "Idempotent blip", "max_tokens": 4, "temperature": 0}
        headers = {"Idempotency-Key": "blip-1"}
        url = f"{federation.base_url}/v1/completions"
        first = httpx.post(url, json=body, headers=headers, timeout=60)
        assert first.status_code == 200, first.text
        retry = httpx.post(url, json=body, headers=headers, timeout=60)
        assert retry.status_code == 200, retry.text
        assert retry.headers["idempotent-replayed"] == "true"
        assert retry.json() == first.json()
        ran = federation.query("SELECT count(*) FROM requests")
        assert ran == [(1,)]
    finally:
        _execute(postgres_url, UNDO)
        federation.gateway.stop()
        downgrade(postgres_url)  # the session's database is shared: leave it empty
