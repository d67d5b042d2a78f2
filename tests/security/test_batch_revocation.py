"""Finding 10 (batches): revoking a key did not stop its queued batch items: a leaked key's
batch kept running on the sites, item after item, after the key was revoked.

Now revoking a key cancels its open batches (the batch runner's revoke hook; a gateway that
claims such a batch later cancels it too): its queued items are cancelled at once, its running
ones stopped at their sites, and the batch ends `cancelled` within seconds.
"""

from __future__ import annotations

import time

import pytest

from tests.e2e.conftest import Federation
from tests.security.batch_keys import KEYS_REQUIRED, admin, client_of, long_items, make_key

pytestmark = pytest.mark.slow
ITEMS, TOKENS = 12, 300


@pytest.fixture(scope="module")
def federation(start_federation) -> Federation:
    return start_federation(
        live=["aws-use1"], env={**KEYS_REQUIRED, "GATEWAY_BATCH_SITE_CONCURRENCY": "1"}
    )


def test_revoking_a_key_stops_its_batch(federation: Federation) -> None:
    leaked = make_key(federation, "leaked")
    with client_of(federation, leaked) as client:
        created = client.post(
            "/v1/batches", json={"model": "tiny", "requests": long_items(ITEMS, TOKENS)}
        )
        assert created.status_code == 200, created.text
        batch_id = created.json()["id"]
        deadline = time.monotonic() + 60
        while "running" not in [r["status"] for r in client.get(
            f"/v1/batches/{batch_id}/results", params={"limit": 100}
        ).json()["data"]]:  # fmt: skip
            assert time.monotonic() < deadline
            time.sleep(0.1)

    with admin(federation) as operator:
        assert operator.delete(f"/admin/api/keys/{leaked['id']}").status_code == 200
    revoked_at = time.monotonic()
    while True:
        ((status, cancelled, completed),) = federation.query(
            f"SELECT status, cancelled, completed FROM batches WHERE id = '{batch_id}'"
        )
        if status == "cancelled":
            break
        assert time.monotonic() - revoked_at < 15, (status, cancelled, completed)
        time.sleep(0.2)
    assert int(str(completed)) <= 2  # one item at a time, 300 tokens each: a few at most
    assert int(str(cancelled)) == ITEMS - int(str(completed))
    # Nothing of the batch runs or starts any more.
    time.sleep(2)
    (running,) = federation.query(
        "SELECT count(*) FROM requests WHERE api = 'batch' AND status = 'dispatched'"
    )
    assert running == (0,)
