"""Sites going down: requests move to a live site, and with none left the client gets a prompt
503 with Retry-After, never a hang."""

from __future__ import annotations

import time

import httpx
import pytest

pytestmark = pytest.mark.slow


def test_requests_fail_over_then_get_503_when_no_site_is_left(start_federation) -> None:
    # A long health interval: the gateway still believes a killed site is healthy, so the
    # failover path (UNAVAILABLE at dispatch -> next site) is what keeps requests alive.
    federation = start_federation(
        live=["aws-use1", "gcp-euw4"], env={"GATEWAY_HEALTH_INTERVAL_S": "300"}
    )
    federation.sites["aws-use1"].kill()
    with httpx.Client(base_url=federation.base_url, timeout=30) as client:
        responses = [
            client.post(
                "/v1/completions", json={"model": "tiny", "prompt": f"p{i}", "max_tokens": 3}
            )
            for i in range(4)
        ]
        assert [r.status_code for r in responses] == [200] * 4
        assert {r.headers["x-fedllm-site"] for r in responses} == {"gcp-euw4"}
        rows = federation.rows("r.status = 'completed'")
        assert max(row["attempts"] for row in rows) == 2  # at least one moved after a failure

        federation.sites["gcp-euw4"].kill()
        started = time.monotonic()
        response = client.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert time.monotonic() - started < 10
    assert response.status_code == 503
    assert response.headers["retry-after"]
    assert response.json()["error"]["code"] == "service_unavailable"
    (failed,) = federation.rows("r.status = 'failed'")
    assert failed["error"]
    assert failed["finished_at"] is not None


@pytest.mark.postgres
def test_gateway_on_postgres_records_requests(start_federation, postgres_url) -> None:
    from gateway.db.migrate import downgrade

    federation = start_federation(live=["azure-jpe"], database_url=postgres_url)
    try:
        response = httpx.post(
            f"{federation.base_url}/v1/completions",
            json={"model": "tiny", "prompt": "hello", "max_tokens": 4},
            timeout=30,
        )
        assert response.status_code == 200
        (row,) = federation.rows()
        assert (row["status"], row["completion_tokens"], row["site_name"]) == (
            "completed",
            4,
            "azure-jpe",
        )
    finally:
        federation.gateway.stop()
        downgrade(postgres_url)
